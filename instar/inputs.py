"""A run's inputs from its config: tasks, the agent class, the model folder and its tokenizer,
and the order in which the training tasks are taken."""

import random
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from instar.agents.contract import Task
from instar.agents.loading import load_agent, load_tasks
from instar.config import Config
from instar.tasks.reverse_data import AGENT_FILE, reverse_data
from instar.tasks.tiny_model import builtin_model


@dataclass
class Inputs:
    train_tasks: list[Task]
    eval_tasks: list[Task]
    agent_cls: type
    model_path: Path
    tokenizer: object


def model_path(cfg: Config) -> Path:
    """The checkpoint folder: `--model.path`, or the built-in model (built on first use)."""
    if cfg.model.path:
        return Path(cfg.model.path).absolute()
    return builtin_model(cfg.model.kind, cfg.model.size, cfg.model.seed)


def run_inputs(cfg: Config) -> Inputs:
    """Training tasks, held-out tasks (at most `--eval.size`), the agent class, the model
    folder and its tokenizer. Empty `--data.train`: the built-in reverse task and its agent."""
    builtin_train, builtin_eval = reverse_data() if not cfg.data.train else ("", "")
    eval_file = cfg.data.eval or builtin_eval
    path = model_path(cfg)
    return Inputs(train_tasks=load_tasks(cfg.data.train or builtin_train),
                  eval_tasks=load_tasks(eval_file)[:cfg.eval.size] if eval_file else [],
                  agent_cls=load_agent(cfg.agent.file or AGENT_FILE), model_path=path,
                  tokenizer=AutoTokenizer.from_pretrained(path))


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
