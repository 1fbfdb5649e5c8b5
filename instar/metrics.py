"""A run's log: what each step logs (`step_metrics`; docs/metrics.md says what each means),
and where it goes: metrics.jsonl (one line a step or eval), TensorBoard event files, and W&B
when a project is configured. Each JSONL line carries `time` (Unix seconds, when it was
written). Non-numeric values (lists of prompt ids) go to the JSONL only."""

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, pstdev

from instar.evaluate import mean
from instar.health import rates
from instar.rollout.runner import Batch
from instar.sample import Sample, one_per_rollout, texts

MISMATCH = ("abs_logprob_diff", "k3")
"""Engine-vs-trainer mismatch on the step's lag-0 tokens, logged under invariants/."""


@dataclass
class StepResult:
    """What one RL step did."""

    step: int
    batch: Batch
    """The step's rollouts as collected: samples, failures, restarts."""
    trained: list[Sample]
    """The samples the update trained on (after dynamic filtering)."""
    stats: dict[str, float]
    """The update's loss and stats (empty if nothing was trained)."""
    probe_diff: float
    """The post-sync probe check of the weights the step's tokens were trained against."""
    engine_stats: list[dict]
    seconds: dict[str, float]
    """wait (for rollouts), train, sync."""
    drawn: int = 0
    """Groups the step drew (more than --data.prompts-per-step when dynamic sampling refills)."""
    filtered: int = 0
    """Groups dropped by dynamic sampling (no reward spread)."""
    sync_bytes: int = 0
    """What the step's weight sync sent each engine."""
    dumped_scores: list[list[float | None]] | None = None
    """On a step that dumps samples (`dumps`): the trainer's log-probs of the dumped ones'
    generated tokens, before the update."""


def dumps(step: int, every: int) -> bool:
    """Whether step `step` writes a group of samples to rollouts.jsonl (--logging.rollouts-every)."""
    return step == 1 or bool(every and step % every == 0)


TRUNCATED = ("length", "max_tokens")
"""An episode's finish_reason when its last turn ran out of tokens (--rollout.max-tokens, or
the episode's token budget)."""


def spread(name: str, xs: list[float]) -> dict[str, float]:
    """Mean, standard deviation, min and max of `xs` (not empty), as name_mean, name_std, ..."""
    return {f"{name}_mean": fmean(xs), f"{name}_std": pstdev(xs), f"{name}_min": min(xs),
            f"{name}_max": max(xs)}


def step_metrics(r: StepResult) -> dict:
    """The step's line of metrics.jsonl."""
    sampled, episodes = r.batch.samples, one_per_rollout(r.batch.samples)
    groups = defaultdict(set)  # group -> its rewards
    for s in episodes:
        groups[s.group_id].add(s.reward)
    lags = Counter(r.step - 1 - v for s in r.trained for v, m in zip(s.versions, s.loss_mask) if m)
    info_keys = {k for s in episodes for k, v in s.info.items()
                 if isinstance(v, int | float) and not isinstance(v, bool)}
    return {
        "step": r.step, "rollout/reward": mean(s.reward for s in episodes),
        "rollout/reward_std": pstdev(s.reward for s in episodes) if episodes else float("nan"),
        "rollout/no_spread_groups": mean(len(rewards) == 1 for rewards in groups.values()),
        "rollout/truncated": mean(s.finish_reason in TRUNCATED for s in episodes),
        **rates(episodes, r.batch.failed),
        **{f"rollout/info/{k}": mean(s.info[k] for s in episodes if k in s.info)
           for k in sorted(info_keys)},
        "rollout/gen_tokens": sum(s.num_generated for s in sampled),
        "rollout/failed": sum(r.batch.failed.values()),
        **{f"rollout/failed/{k}": v for k, v in r.batch.failed.items()},
        "rollout/restarted": r.batch.restarted, "rollout/retried": r.batch.retried,
        "rollout/dropped_groups": r.batch.dropped_groups,
        "rollout/drawn_groups": r.drawn, "rollout/filtered_groups": r.filtered,
        "lengths/sampled_mean": mean(s.num_generated for s in sampled),
        "lengths/trained_mean": mean(s.num_generated for s in r.trained),
        **{f"engine/{i}/{k}": v for i, s in enumerate(r.engine_stats) for k, v in s.items()},
        **{f"train/{k}": v for k, v in r.stats.items() if k not in MISMATCH},
        **{f"invariants/{k}": r.stats[k] for k in MISMATCH if k in r.stats},
        "invariants/sync_probe_diff": r.probe_diff,
        **{f"staleness/lag_{k}": n / sum(lags.values()) for k, n in sorted(lags.items())},
        "staleness/max": max(lags, default=0),
        **{f"timing/{k}_s": v for k, v in r.seconds.items()},
        "timing/step_s": sum(r.seconds.values()),
        "perf/gen_tokens_per_s": sum(s["tokens_per_s"] for s in r.engine_stats),
        "perf/sync_bytes": r.sync_bytes,
        "prompts": [s.task_id for s in {s.group_id: s for s in sampled}.values()],  # one a group
    }


class RunLog:
    def __init__(self, run_dir: Path, config: dict, *, resume: bool, tensorboard: bool,
                 wandb_project: str):
        self.file = open(run_dir / "metrics.jsonl", "a" if resume else "w")
        self.tb = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("--logging.wandb-project needs wandb: pip install wandb") from e
            self.wandb = wandb.init(project=wandb_project, name=run_dir.name, config=config,
                                    dir=str(run_dir), resume="allow")

    def log(self, m: dict, step: int) -> None:
        self.file.write(json.dumps({**m, "time": round(time.time(), 3)}) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in m.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(numbers, step=step)

    def text(self, tag: str, s: Sample, tokenizer, step: int) -> None:
        """One sample's decoded text (TensorBoard's Text tab)."""
        if self.tb:
            t = texts(s, tokenizer)
            self.tb.add_text(tag, f"reward {s.reward:.3f}, {s.finish_reason}\n\n```\n"
                             f"{t['prompt_text']}\n```\n\n```\n{t['completion_text']}\n```", step)

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
