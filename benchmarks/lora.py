"""LoRA against full training on the small built-in model (about 24M params), side by side in
one run, on this machine:

  - per weight sync: the bytes sent to each engine and the seconds the sync took (the RL
    loop's own `perf/sync_bytes` and `timing/sync_s`), and the seconds of a step's rollouts,
    training and whole step, each the median of an `instar rl` run of STEPS steps (the first
    two left out), with and without `--lora.rank 8`;
  - trainer memory per rank: each FSDP2 rank's peak resident memory and the bytes of its
    optimizer state, after three supervised steps on 128 sequences of an RL step's shape.

    .venv/bin/python benchmarks/lora.py   # writes benchmarks/results/lora.json
"""

import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from instar.cli import main as instar
from instar.config import Config
from instar.tasks.tiny_model import builtin_model
from instar.train.batch import Sequence
from instar.train.trainer import Trainer

STEPS, RANK = 8, 8


def config(lora_rank: int) -> Config:
    cfg = Config()
    cfg.model.size, cfg.data.task = "small", "reverse"
    cfg.train.steps, cfg.train.warmup_sft_steps = STEPS, 0
    cfg.eval.size, cfg.logging.progress, cfg.checkpoint.save_final = 0, False, False
    cfg.rollout.max_staleness = 0  # rollout, train and sync one after another: each timed alone
    cfg.lora.rank = lora_rank
    return cfg


def rl_run(lora_rank: int) -> dict:
    cfg = config(lora_rank)
    cfg.logging.root, cfg.logging.name = tempfile.mkdtemp(), "run"
    recipe = Path(cfg.logging.root) / "recipe.yaml"
    recipe.write_text(cfg.to_yaml())
    instar(["rl", "--config", str(recipe)])
    lines = [json.loads(x) for x in (Path(cfg.logging.root) / "run" / "metrics.jsonl").open()]
    measured = [m for m in lines if "rollout/reward" in m][2:]  # the first steps warm up
    med = lambda k: statistics.median(m[k] for m in measured)  # noqa: E731
    return {"sync_bytes": int(med("perf/sync_bytes")), "sync_s": round(med("timing/sync_s"), 4),
            "rollout_s": round(med("timing/wait_s"), 3), "train_step_s": round(med("timing/train_s"), 3),
            "step_s": round(med("timing/step_s"), 3), "steps_measured": len(measured)}


def memory(lora_rank: int) -> dict:
    """Each rank's peak RSS (MB) and optimizer-state bytes after three supervised steps."""
    cfg = config(lora_rank).validate()
    trainer = Trainer(cfg, str(builtin_model("dense", "small")))
    try:
        g = torch.Generator().manual_seed(0)
        seqs = [Sequence(ids := torch.randint(3, 500, (40,), generator=g).tolist(),
                         [False] * 16 + [True] * 24, [0.0] * len(ids)) for _ in range(128)]
        for _ in range(3):
            trainer.step(seqs, "sft", lr=1e-3)

        def measure(rank):
            state = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                        for s in rank.opt.state.values() for t in s.values() if t.dim())
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, state
        per_rank = ray.get([w.__ray_call__.remote(measure) for w in trainer.workers])
    finally:
        trainer.shutdown()
    return {"peak_rss_mb": [round(m) for m, _ in per_rank],
            "optimizer_state_bytes": [s for _, s in per_rank]}


def main():
    result = {}
    with ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False):
        for name, rank in (("full", 0), (f"lora_r{RANK}", RANK)):
            result[name] = {**rl_run(rank), **memory(rank)}
    full, lora = result["full"], result[f"lora_r{RANK}"]
    result["ratios"] = {  # LoRA over full training
        "sync_bytes": round(lora["sync_bytes"] / full["sync_bytes"], 4),
        "sync_s": round(lora["sync_s"] / full["sync_s"], 3),
        "rollout_s": round(lora["rollout_s"] / full["rollout_s"], 3),
        "train_step_s": round(lora["train_step_s"] / full["train_step_s"], 3),
        "step_s": round(lora["step_s"] / full["step_s"], 3),
        "peak_rss": round(sum(lora["peak_rss_mb"]) / sum(full["peak_rss_mb"]), 3),
        "optimizer_state": round(sum(lora["optimizer_state_bytes"]) /
                                 sum(full["optimizer_state_bytes"]), 4)}
    cfg = config(0).validate()
    result["setup"] = {
        "model": "built-in small dense (about 24M params), float32",
        "lora": f"rank {RANK}, alpha {cfg.lora.alpha}, every linear layer of the decoder",
        "batch": f"{cfg.data.prompts_per_step} prompts x {cfg.rollout.group_size} samples, "
                 f"up to {cfg.rollout.max_tokens} new tokens; 2 FSDP2 ranks, 1 engine",
        "sync": "full: each rank's shards through /dev/shm into vLLM reload_weights; LoRA: "
                "the adapter through Ray's object store into vLLM add_lora",
        "machine": "2 cores, CPU only", "date": time.strftime("%Y-%m-%d")}
    out = Path(__file__).parent / "results" / "lora.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
