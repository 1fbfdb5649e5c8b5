"""Sync vs async RL steps, in one invocation, on two workloads where rollout and training
take comparable time:

  - `compute` (the result's top level): the small built-in model (23.9M), 2 tasks x 4
    samples of exactly 128 tokens. Decoding few sequences is memory-bound, so generation
    costs about as much wall time as training, and the model's own compute dominates both;
  - `overhead` (under "tiny_model"): the tiny model (361K), 16 tasks x 8 samples of up to
    24 tokens. The model costs almost nothing; vLLM's per-request work (its front end in
    the engine actor, output processing) and the episode loop dominate the rollout side.

Per workload:
  - sync_step_s: median step with --rollout.max-staleness 0 (generate, then train, then
    sync: nothing overlaps);
  - async_step_s: median step with --rollout.max-staleness 1 (the next step's episodes are
    generated while the trainer trains and syncs);
  - overlap_efficiency: max(rollout, train + sync) / async_step_s, with rollout and
    train + sync timed in the sync runs; 1.0 is perfect overlap;
  - cpu_s_per_step: CPU seconds per step of each kind of process in the last sync run; over
    the machine's cores, their sum bounds the async step from below, whatever overlaps.
Each mode runs ROUNDS times, alternating (sync, async, sync, ...); the medians are over the
measured steps of all its runs (runs vary more than steps on a small machine).

On a CPU machine the engine and the trainer share the cores, so each gets one thread (the
engine 1, the trainer 1 rank x 1 thread) and overlap needs 2 cores.

    .venv/bin/python benchmarks/async.py   # writes benchmarks/results/async.json
"""

import json
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from instar import metrics
from instar.cli import main as instar
from instar.config import Config

ROUNDS = 2
WORKLOADS = {  # name: (model size, tasks, samples, max tokens, fixed length, steps, warm-up)
    "compute": ("small", 2, 4, 128, True, 10, 3),
    "overhead": ("tiny", 16, 8, 24, False, 14, 4),
}


def cpu_seconds() -> Counter:
    """CPU seconds so far of this machine's processes, by kind (Linux /proc)."""
    out, tick = Counter(), os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        name, fields = stat.split("(", 1)[1].rsplit(")", 1)
        kind = ("engine core" if "EngineCor" in name else "engine actor" if "ray::Engine" in cmd
                else "trainer" if "TrainWorker" in cmd else "driver" if int(pid) == os.getpid()
                else "other")
        out[kind] += (int(fields.split()[11]) + int(fields.split()[12])) / tick
    return out


def step_times(workload: str, max_staleness: int) -> tuple[list[dict], dict]:
    """The measured steps' metrics; CPU seconds per measured step by kind of process."""
    size, tasks, samples, max_tokens, fixed, steps, warmup = WORKLOADS[workload]
    cfg = Config()
    cfg.data.task = "reverse"
    cfg.model.size, cfg.train.steps, cfg.train.warmup_sft_steps = size, steps, 0
    cfg.train.num_ranks, cfg.train.threads_per_rank, cfg.rollout.threads = 1, 1, 1
    cfg.data.prompts_per_step, cfg.rollout.group_size = tasks, samples
    cfg.rollout.max_tokens, cfg.rollout.ignore_eos = max_tokens, fixed
    cfg.rollout.max_staleness = max_staleness
    cfg.rollout.schedule = "overlap"  # (staleness 0: generate, then train; 1: overlapped)
    cfg.eval.size, cfg.rollout.preflight, cfg.checkpoint.save_final = 0, 0, False
    cfg.logging.progress, cfg.logging.plots, cfg.logging.tensorboard = False, False, False
    cfg.logging.root, cfg.logging.name = tempfile.mkdtemp(), f"async-{max_staleness}"
    marks, log = {}, metrics.RunLog.log

    def log_and_mark(self, m, step):  # CPU counters at the first and last measured step
        if "rollout/reward" in m and step in (warmup, steps):
            marks[step] = cpu_seconds()
        return log(self, m, step)
    metrics.RunLog.log = log_and_mark
    recipe = Path(cfg.logging.root) / "recipe.yaml"
    recipe.write_text(cfg.to_yaml())
    try:
        instar(["rl", "--config", str(recipe)])  # in this process: its CPU time is the driver's
    finally:
        metrics.RunLog.log = log
    lines = (Path(cfg.logging.root) / cfg.logging.name / "metrics.jsonl").read_text()
    cpu = {k: round((marks[steps][k] - marks[warmup][k]) / (steps - warmup), 3)
           for k in marks[steps]}
    return [m for x in lines.splitlines() if "rollout/reward" in (m := json.loads(x))][warmup:], cpu


def med(steps: list[dict], *keys: str) -> float:
    return statistics.median(sum(m[k] for k in keys) for m in steps)


def measure(workload: str) -> dict:
    runs = [step_times(workload, max_staleness) for _ in range(ROUNDS) for max_staleness in (0, 1)]
    sync, overlapped = sum((r[0] for r in runs[0::2]), []), sum((r[0] for r in runs[1::2]), [])
    rollout, train = med(sync, "timing/wait_s"), med(sync, "timing/train_s", "timing/sync_s")
    size, tasks, samples, max_tokens, fixed, steps, warmup = WORKLOADS[workload]
    return {
        "sync_step_s": round(med(sync, "timing/step_s"), 3),
        "async_step_s": round(med(overlapped, "timing/step_s"), 3),
        "overlap_efficiency": round(max(rollout, train) / med(overlapped, "timing/step_s"), 3),
        "sync_run": {"rollout_s": round(rollout, 3), "train_and_sync_s": round(train, 3)},
        "async_run": {"wait_s": round(med(overlapped, "timing/wait_s"), 3),
                      "train_s": round(med(overlapped, "timing/train_s"), 3),
                      "sync_s": round(med(overlapped, "timing/sync_s"), 3),
                      "max_staleness_seen": max(m["staleness/max"] for m in overlapped)},
        "cpu_s_per_step": runs[-2][1],
        "setup": {"model": f"built-in {size} dense", "prompts_per_step": tasks,
                  "group_size": samples, "max_tokens": max_tokens, "fixed_length": fixed,
                  "engine_threads": 1, "trainer": "1 rank x 1 thread", "steps": steps,
                  "runs_per_mode": ROUNDS,
                  "measured": f"median of steps {warmup + 1}-{steps} of every run",
                  "cpus": os.cpu_count()},
    }


def main():
    result = measure("compute")
    result["tiny_model"] = measure("overhead")
    out = Path(__file__).parent / "results" / "async.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
