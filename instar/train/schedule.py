"""The learning-rate schedule: linear warm-up, then constant or a cosine decay."""

import math

from instar.config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warm-up to `t.lr`, then constant or a cosine down to `t.min_lr_ratio * t.lr`."""
    if step <= t.lr_warmup_steps:
        return t.lr * step / t.lr_warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    done = (step - t.lr_warmup_steps) / max(1, t.steps - t.lr_warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * done)) / 2)
