"""A run's inputs from its config: tasks, the agent class, the model folder and its tokenizer,
and the order in which the training tasks are taken."""

import random
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from instar.agents.contract import Task
from instar.agents.loading import load_agent
from instar.config import Config
from instar.data import load_task_data
from instar.hub import resolve_model
from instar.rollout.parsers import check as check_parsers
from instar.tasks.builtin import task_agent, task_data
from instar.tasks.tiny_model import builtin_model
from instar.train import lora
from instar.train.sft import check_images
from instar.train.sft_data import load_sft_jsonl


@dataclass
class Inputs:
    train_tasks: list[Task]
    eval_tasks: list[Task]
    agent_cls: type
    model_path: Path
    tokenizer: object
    warmup_rows: list[dict] | None  # the warm-up's demonstrations (None: the tasks' labels)


def model_path(cfg: Config) -> Path:
    """The checkpoint folder: `--model.path` (a folder or a Hub id, instar/hub.py), or the
    built-in model (built on first use)."""
    if cfg.model.path:
        return resolve_model(cfg.model.path, "--model.path")
    return builtin_model(cfg.model.kind, cfg.model.size, cfg.model.seed)


def other_model_paths(cfg: Config) -> dict[str, Path]:
    """The folders of the judge, teacher and reference models the run names (read where their
    engines and trainers start, and first by `run_inputs`, so a wrong one fails early)."""
    named = {"judge": ("--agent.judge", "" if cfg.agent.judge == "policy" else cfg.agent.judge),
             "teacher": ("--algo.teacher", cfg.algo.teacher),
             "reference": ("--algo.reference", cfg.algo.reference)}
    return {name: resolve_model(spec, flag) for name, (flag, spec) in named.items() if spec}


def run_inputs(cfg: Config) -> Inputs:
    """Training tasks, held-out tasks (at most `--eval.size`), the agent class, the model
    folder, its tokenizer and the warm-up's demonstrations; the other models named are checked
    too. Empty `--data.train`: the built-in task's data and demonstrations (--data.task); empty
    `--agent`: its agent. Data formats: instar/data.py."""
    d, t = cfg.data, cfg.train
    builtin_train, builtin_eval, demos = task_data(d.task) if not d.train else ("", "", "")
    eval_file, demos = d.eval or builtin_eval, t.warmup_sft_data or demos
    path = model_path(cfg)
    other_model_paths(cfg)
    check_parsers(cfg.model.tool_parser, cfg.model.reasoning_parser)
    warmup_rows = load_sft_jsonl(demos) if t.warmup_sft_steps and demos else None
    if warmup_rows:  # (refused now, not mid-run)
        check_images(warmup_rows, path, demos)
    if cfg.lora.rank or cfg.lora.path:  # (an adapter the engines cannot serve is refused now)
        lora.engine_modules(str(path), lora.read(cfg.lora.path)["config"]["target_modules"]
                            if cfg.lora.path else cfg.lora.targets)
    return Inputs(
        train_tasks=load_task_data(d.train or builtin_train, d.prompt_key, d.label_key),
        eval_tasks=load_task_data(eval_file, d.prompt_key, d.label_key, "--data.eval")[
            :cfg.eval.size] if eval_file else [],
        agent_cls=load_agent(cfg.agent.file or task_agent(d.task)), model_path=path,
        tokenizer=AutoTokenizer.from_pretrained(path), warmup_rows=warmup_rows)


def task_order(tasks: list[Task], seed: int):
    """The run's task sequence: ticket t -> a task; each epoch a fresh shuffle, fixed by the
    seed, so a resumed run knows which prompts come next from the step alone."""
    epochs: dict[int, list[int]] = {}

    def task_at(t: int) -> Task:
        epoch, i = divmod(t, len(tasks))
        if epoch not in epochs:
            epochs[epoch] = list(range(len(tasks)))
            random.Random(f"{seed}/{epoch}").shuffle(epochs[epoch])
        return tasks[epochs[epoch][i]]
    return task_at
