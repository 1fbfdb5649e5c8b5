"""How a step's sequences are packed into micro-batches, timed on a grpo-small-shaped batch.

128 sequences on the small built-in model (float32): prompts of 12-17 tokens, 70% of replies
cut at 128 tokens, the rest of 5-127 (as bench.py's grpo-small samples them before it learns).
One policy-gradient step (`Trainer.step`) for each of:
  - packing: instar's (`batch.shard`: the fewest micro-batches, then the fewest padded
    tokens) against filling micro-batches in order up to the budget (instar's packing before
    2026-12-06, kept here as the baseline);
  - 2 ranks x 1 thread and 1 rank x 2 threads; budgets of 8192 and 2048 tokens.
Four steps each, the first not counted; written to benchmarks/results/packing.json.

    .venv/bin/python benchmarks/packing.py
"""

import json
import random
import statistics
import time
from pathlib import Path

import ray

import instar.train.trainer as trainer_module
from instar.config import Config
from instar.tasks.tiny_model import builtin_model
from instar.train.batch import Sequence, shard


def in_order(seqs: list[Sequence], world: int, budget: int) -> list[list[list[Sequence]]]:
    """The baseline: each rank's sequences fill a micro-batch, in order, up to the budget."""
    per_rank = []
    for r in range(world):
        batches: list[list[Sequence]] = [[]]
        for s in seqs[r::world]:
            longest = max([len(x.tokens) for x in batches[-1]] + [len(s.tokens)])
            if batches[-1] and longest * (len(batches[-1]) + 1) > budget:
                batches.append([])
            batches[-1].append(s)
        per_rank.append(batches)
    n = max(len(b) for b in per_rank)
    return [b + [[] for _ in range(n - len(b))] for b in per_rank]


def batch(n: int = 128) -> list[Sequence]:
    rng, seqs = random.Random(0), []
    for _ in range(n):
        p = rng.randint(12, 17)
        g = 128 if rng.random() < 0.7 else rng.randint(5, 127)
        seqs.append(Sequence([rng.randrange(512) for _ in range(p + g)], [False] * p + [True] * g,
                             [-6.0] * (p + g), advantages=[rng.gauss(0, 1)] * (p + g)))
    return seqs


def main():
    seqs, path = batch(), builtin_model("dense", "small", 0)
    ordered = sorted(seqs, key=lambda s: len(s.tokens))  # (as the trainer sorts them)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs = {}
    for ranks, threads, budget, name, packer in [
            (2, 1, 8192, "instar", shard), (2, 1, 8192, "in_order", in_order),
            (1, 2, 8192, "instar", shard), (1, 2, 8192, "in_order", in_order),
            (2, 1, 2048, "instar", shard), (1, 2, 2048, "instar", shard)]:
        trainer_module.shard = packer  # what Trainer.step splits the batch with
        cfg = Config().validate()
        cfg.train.num_ranks, cfg.train.threads_per_rank = ranks, threads
        cfg.train.micro_batch_tokens = budget
        trainer = trainer_module.Trainer(cfg, str(path))
        seconds = []
        for _ in range(4):
            start = time.perf_counter()
            trainer.step(seqs, "pg", 1e-5)
            seconds.append(time.perf_counter() - start)
        trainer.shutdown()
        parts = packer(ordered, ranks, budget)
        key = f"{ranks}x{threads} {name} {budget}"
        runs[key] = {"step_s": [round(t, 2) for t in seconds],
                     "median_s": round(statistics.median(seconds[1:]), 2),
                     "padded_tokens": sum(max(map(len, (s.tokens for s in mb)), default=0) * len(mb)
                                          for rank in parts for mb in rank),
                     "micro_batches_per_rank": len(parts[0])}
        print(key, runs[key], flush=True)
    ray.shutdown()
    result = {"real_tokens": sum(len(s.tokens) for s in seqs), "runs": runs,
              "in_order_over_instar": {layout: round(runs[f"{layout} in_order 8192"]["median_s"] /
                                                     runs[f"{layout} instar 8192"]["median_s"], 3)
                                       for layout in ("2x1", "1x2")}}
    out = Path(__file__).parent / "results" / "packing.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["in_order_over_instar"]))


if __name__ == "__main__":
    main()
