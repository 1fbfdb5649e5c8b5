"""Held-out evaluation: mean reward, pass@k (k = 1, 2, 4, ... up to the samples per task),
and the mean reward per data source (a task's `source` column) when tasks have one."""

from collections import defaultdict
from collections.abc import Callable
from math import comb

from instar.agents.contract import Task
from instar.config import EvalConfig
from instar.rollout.runner import Batch, Rollouts
from instar.sample import one_per_rollout


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples, drawn without replacement from n of which c
    pass, passes (the unbiased estimator of pass@k from n >= k samples)."""
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(rollouts: Rollouts, tasks: list[Task], e: EvalConfig, max_tokens: int,
             tag: str, done: Callable[[int], None] = lambda n: None) -> tuple[dict[str, float], Batch]:
    """Run `e.samples` episodes of each task; a failed episode counts as reward 0. `done(n)`
    as each task's episodes end."""
    sampling = {"temperature": e.temperature, "max_tokens": e.max_tokens or max_tokens}
    batch = rollouts.run(tasks, e.samples, sampling, tag, done)
    rewards = defaultdict(list)
    for s in one_per_rollout(batch.samples):
        rewards[s.task_id].append(s.reward)
    per_task = {t.id: rewards[t.id] + [0.0] * (e.samples - len(rewards[t.id])) for t in tasks}
    m = {"eval/reward": mean(r for rs in per_task.values() for r in rs)}
    k = 1
    while k <= e.samples:
        m[f"eval/pass@{k}"] = mean(pass_at_k(e.samples, sum(r >= e.pass_threshold for r in rs), k)
                                   for rs in per_task.values())
        k *= 2
    sources = defaultdict(list)
    for t in tasks:
        if "source" in t.data:
            sources[t.data["source"]] += per_task[t.id]
    m.update({f"eval/{src}/reward": mean(rs) for src, rs in sorted(sources.items())})
    return m, batch


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")
