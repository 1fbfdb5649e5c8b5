"""Sync vs async RL steps on one workload where rollout and training take comparable time,
in one invocation:

  - sync_step_s: median step with --rollout.max-staleness 0 (generate, then train, then
    sync: nothing overlaps);
  - async_step_s: median step with --rollout.max-staleness 1 (the next step's episodes are
    generated while the trainer trains and syncs);
  - overlap_efficiency: max(rollout, train + sync) / async_step_s, with rollout and
    train + sync timed in the sync run; 1.0 is perfect overlap.

On a CPU machine the engine and the trainer share the cores, so the workload gives each one
thread (the engine 1, the trainer 1 rank x 1 thread) and overlap needs 2 cores.

    .venv/bin/python benchmarks/async.py   # writes benchmarks/results/async.json
"""

import json
import os
import statistics
import tempfile
from pathlib import Path

from instar.config import Config
from instar.loop import run

STEPS, WARMUP = 14, 4


def step_times(max_staleness: int) -> list[dict]:
    cfg = Config()
    cfg.train.steps, cfg.train.warmup_sft_steps = STEPS, 0
    cfg.train.num_ranks, cfg.train.threads_per_rank, cfg.rollout.threads = 1, 1, 1
    cfg.data.prompts_per_step, cfg.rollout.group_size = 16, 8
    cfg.rollout.max_tokens, cfg.rollout.max_staleness = 24, max_staleness
    cfg.eval.size, cfg.rollout.preflight, cfg.checkpoint.save_final = 0, 0, False
    cfg.logging.progress, cfg.logging.plots, cfg.logging.tensorboard = False, False, False
    cfg.logging.root, cfg.logging.name = tempfile.mkdtemp(), f"async-{max_staleness}"
    run(cfg)
    lines = (Path(cfg.logging.root) / cfg.logging.name / "metrics.jsonl").read_text()
    return [m for x in lines.splitlines() if "rollout/reward" in (m := json.loads(x))][WARMUP:]


def med(steps: list[dict], *keys: str) -> float:
    return statistics.median(sum(m[k] for k in keys) for m in steps)


def main():
    sync, overlapped = step_times(0), step_times(1)
    rollout, train = med(sync, "timing/wait_s"), med(sync, "timing/train_s", "timing/sync_s")
    result = {
        "sync_step_s": round(med(sync, "timing/step_s"), 3),
        "async_step_s": round(med(overlapped, "timing/step_s"), 3),
        "overlap_efficiency": round(max(rollout, train) / med(overlapped, "timing/step_s"), 3),
        "sync_run": {"rollout_s": round(rollout, 3), "train_and_sync_s": round(train, 3)},
        "async_run": {"wait_s": round(med(overlapped, "timing/wait_s"), 3),
                      "train_s": round(med(overlapped, "timing/train_s"), 3),
                      "sync_s": round(med(overlapped, "timing/sync_s"), 3),
                      "max_staleness_seen": max(m["staleness/max"] for m in overlapped)},
        "setup": {"model": "built-in tiny dense", "prompts_per_step": 16, "group_size": 8,
                  "max_tokens": 24, "engine_threads": 1, "trainer": "1 rank x 1 thread",
                  "steps": STEPS, "measured": f"median of steps {WARMUP + 1}-{STEPS}",
                  "cpus": os.cpu_count()},
    }
    out = Path(__file__).parent / "results" / "async.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
