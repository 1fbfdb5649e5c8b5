"""Weight-sync cost on the small built-in model (about 24M params), in one run:

  - sync_seconds: median time per step to push the trainer's weights into the engine
    (each FSDP2 rank writes its shards to /dev/shm, vLLM reloads them) plus the
    fingerprint check, from the RL loop's own timing;
  - sync_share_of_step: that time over the whole step (rollout + train + sync);
  - bandwidth_fraction_of_memcpy: bytes moved per second by the sync, over a plain
    in-memory copy of the same tensors measured in the same process.

    .venv/bin/python benchmarks/sync.py   # writes benchmarks/results/sync.json
"""

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from instar.cli import main as instar
from instar.config import Config
from instar.tasks.tiny_model import builtin_model

STEPS = 8


def main():
    cfg = Config()
    cfg.model.size, cfg.data.task = "small", "reverse"
    cfg.train.steps, cfg.train.warmup_sft_steps = STEPS, 0
    cfg.eval.size, cfg.logging.progress = 0, False
    cfg.checkpoint.save_final = False
    cfg.rollout.max_staleness = 0  # rollout, train and sync one after another: each timed alone
    cfg.logging.root, cfg.logging.name = tempfile.mkdtemp(), "sync-bench"
    recipe = Path(cfg.logging.root) / "recipe.yaml"
    recipe.write_text(cfg.to_yaml())
    instar(["rl", "--config", str(recipe)])
    metrics = [json.loads(x) for x in
               (Path(cfg.logging.root) / "sync-bench" / "metrics.jsonl").read_text().splitlines()]
    measured = [m for m in metrics if "rollout/reward" in m][2:]  # the first steps warm up
    med = lambda k: statistics.median(m[k] for m in measured)  # noqa: E731
    step = med("timing/wait_s") + med("timing/train_s") + med("timing/sync_s")

    weights = load_file(str(builtin_model("dense", "small") / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        copied = {k: v.clone() for k, v in weights.items()}
        copies.append(time.perf_counter() - start)
    del copied
    memcpy_s = statistics.median(copies)
    result = {
        "sync_seconds": round(med("timing/sync_s"), 4),
        "sync_share_of_step": round(med("timing/sync_s") / step, 4),
        "bandwidth_fraction_of_memcpy": round(memcpy_s / med("timing/sync_s"), 4),
        "step_seconds": {"rollout": round(med("timing/wait_s"), 3),
                         "train": round(med("timing/train_s"), 3),
                         "sync": round(med("timing/sync_s"), 3)},
        "weights_mb": round(nbytes / 2**20, 1), "memcpy_seconds": round(memcpy_s, 4),
        "setup": {"model": "built-in small dense", "params": sum(t.numel() for t in weights.values()),
                  "batch": f"{cfg.data.prompts_per_step} prompts x {cfg.rollout.group_size} samples, "
                           f"up to {cfg.rollout.max_tokens} new tokens",
                  "transport": "each trainer rank writes its shards (safetensors, /dev/shm); the engine concatenates them into vLLM reload_weights",
                  "steps_measured": len(measured), "machine": "2 cores, CPU only",
                  "date": time.strftime("%Y-%m-%d"), "torch_threads": torch.get_num_threads()},
    }
    out = Path(__file__).parent / "results" / "sync.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
