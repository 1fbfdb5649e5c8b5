"""The TRL side of benchmarks/bench.py: one workload with TRL's GRPOTrainer, on CPU.

bench.py runs this file in a subprocess with TRL on PYTHONPATH (TRL is not a dependency of
instar; the install line is in bench.py's docstring):

    PYTHONPATH=/tmp/trl-site .venv/bin/python benchmarks/bench_trl.py SPEC.json OUT.json

SPEC.json holds the workload (bench_tasks.Workload's fields), the model folder and the tasks
JSONL in the order the steps take them. OUT.json gets one record per optimizer step: wall
seconds, seconds in the rollout (generation, tool calls, rewards), generated tokens, tokens
trained (prompt + completion, tool results included), sequences.

- single turn: the stock GRPOTrainer; generation by transformers `generate` on the policy.
- agentic, agentic-tail: GRPOTrainer with a `rollout_func` (TRL's custom-rollout hook). Each
  turn, all live episodes are generated in one batch with the trainer's own generation (the
  method its built-in tool loop calls); every turn that ended its message, and is not its
  episode's last, is a tool call, all of a turn's calls at once (TRL's built-in `tools=` loop
  would await them one episode after another); tool results are appended with instar's
  chat-template continuation and masked out of the loss (`env_mask`). The turn rule is
  instar's: a cut-off turn ends the episode. Each episode's turn count and tool latencies
  come from bench_tasks.episode_plan with the (task id, sample index) instar's agent uses.
"""

import asyncio
import json
import sys
import tempfile
import time
from collections import Counter

import torch
from bench_tasks import Workload, episode_plan, score, shift, tool_result
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from instar.agents.chat import continuation_ids, prompt_ids

MICRO_TOKENS = 8192  # tokens per micro-batch, as instar's default --train.micro-batch-tokens


class Timed(GRPOTrainer):
    """GRPOTrainer that records what each rollout took and produced."""

    rollouts: list[dict] = []

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        self.task_ids = [x["id"] for x in inputs]  # for the rollout_func: it gets the prompts only
        out = super()._generate_and_score_completions(inputs)
        generated = out["completion_mask"] * out.get("tool_mask", 1)
        self.rollouts.append({
            "rollout_s": time.perf_counter() - start, "gen_tokens": int(generated.sum()),
            "trained_tokens": int(out["prompt_mask"].sum() + out["completion_mask"].sum()),
            "seqs": len(inputs), "turns": getattr(self, "turns", 1),
            "tool_s": getattr(self, "tool_s", 0.0),
            "prompts": list(dict.fromkeys(x["id"] for x in inputs))})
        return out


class StepClock(TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_train_begin(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())


def plans(w: Workload, task_ids: list[str]) -> list[tuple[int, list[float]]]:
    """Each episode's (turns, tool latencies): the k-th occurrence of a task is its sample k."""
    seen = Counter()
    out = []
    for t in task_ids:
        out.append(episode_plan(t, seen[t], **w.plan))
        seen[t] += 1
    return out


def agentic_rollout(w: Workload):
    """A `rollout_func`: each episode's planned model turns, a tool call after each complete
    one but the last."""
    async def tool_calls(latencies: list[float]):
        await asyncio.gather(*(asyncio.sleep(s) for s in latencies))

    def rollout(prompts: list, trainer: GRPOTrainer) -> dict:
        tok, n = trainer.processing_class, len(prompts)
        trainer.generation_config.max_new_tokens = w.max_tokens  # per turn
        plan = plans(w, trainer.task_ids)
        messages = [list(p) for p in prompts]
        strings = [p[-1]["content"].removeprefix("Reverse: ") for p in prompts]
        prompt = [prompt_ids(tok, m, None) for m in messages]
        completion, mask = [[] for _ in range(n)], [[] for _ in range(n)]
        reward, turns, live, tool_s = [0.0] * n, [0] * n, list(range(n)), 0.0
        for turn in range(w.turns):
            if not live:
                break
            generated, _ = trainer._generate_single_turn(
                [prompt[i] + completion[i] for i in live], None, {}, 1)
            go_on = []
            for i, ids in zip(live, generated):
                text = tok.decode(ids, skip_special_tokens=True)
                completion[i] += ids
                mask[i] += [1] * len(ids)
                reward[i] += score(text, strings[i][::-1]) / plan[i][0]
                turns[i] += 1
                if turn + 1 < plan[i][0] and ids[-1:] == [tok.eos_token_id]:
                    go_on.append(i)
                    messages[i] = messages[i] + [{"role": "assistant", "content": text}]
            latencies = [plan[i][1][turn] for i in go_on]
            asyncio.run(tool_calls(latencies))
            tool_s += sum(latencies)
            for i in go_on:
                after = messages[i] + tool_result(strings[i])
                obs = continuation_ids(tok, messages[i], after, None, True)
                completion[i] += obs
                mask[i] += [0] * len(obs)
                messages[i], strings[i] = after, shift(strings[i])
            live = go_on
        trainer.turns, trainer.tool_s = sum(turns) / n, tool_s / n
        return {"prompt_ids": prompt, "completion_ids": completion, "logprobs": None,
                "env_mask": mask, "episode_reward": reward}
    return rollout


def main(spec_file: str, out_file: str):
    spec = json.loads(open(spec_file).read())
    w = Workload(**spec["workload"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    rows = [json.loads(x) for x in open(spec["tasks"])]
    data = Dataset.from_list([{"id": r["id"], "label": r["label"],
                               "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    batch = w.prompts_per_step * w.group_size
    longest = max(len(prompt_ids(tok, [{"role": "user", "content": r["prompt"]}], None))
                  for r in rows) + w.max_tokens * w.turns
    micro = max([d for d in range(1, batch + 1) if batch % d == 0 and d * longest <= MICRO_TOKENS],
                default=1)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        max_steps=w.warmup_steps + w.steps, shuffle_dataset=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=w.group_size, max_completion_length=w.max_tokens * w.turns
        + (w.turns - 1) * 32, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", bf16=w.dtype == "bfloat16",
        gradient_checkpointing=False,
        generation_kwargs={"min_new_tokens": w.max_tokens} if w.fixed_length else None)
    if w.turns > 1:
        def reward(completions, episode_reward, **kw):
            return episode_reward
    else:
        def reward(completions, label, **kw):
            return [score(c[0]["content"], y) for c, y in zip(completions, label)]
    clock = StepClock()
    trainer = Timed(model=spec["model"], reward_funcs=reward, args=args, train_dataset=data,
                    processing_class=tok, callbacks=[clock],
                    rollout_func=agentic_rollout(w) if w.turns > 1 else None)
    trainer.train()
    steps = [{**r, "step_s": b - a} for r, a, b in zip(Timed.rollouts, clock.ends, clock.ends[1:])]
    settings = {"trl": __import__("trl").__version__, "torch_threads": torch.get_num_threads(),
                "micro_batch": micro, "grad_accum": batch // micro,
                "generation": "rollout_func (see bench_trl.py)" if w.turns > 1
                else "transformers generate (GRPOTrainer default, use_vllm=False)",
                **{k: getattr(args, k) for k in (
                    "learning_rate", "optim", "adam_beta1", "adam_beta2", "adam_epsilon",
                    "weight_decay", "max_grad_norm", "lr_scheduler_type", "beta", "epsilon",
                    "loss_type", "bf16", "gradient_checkpointing", "num_generations",
                    "max_completion_length", "temperature", "scale_rewards",
                    "generation_kwargs")}}
    open(out_file, "w").write(json.dumps({"steps": steps, "settings": settings}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
