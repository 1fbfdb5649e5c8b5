"""Training throughput of instar's FSDP2 path on the small built-in model (about 24M params,
float32), against a plain single-process transformers loop on the same data, and the model
FLOPs utilisation against this machine's matmul peak, all measured in one run:

  - plain: one process, all cores, AdamW, forward + token log-probs + backward + step;
  - instar: `Trainer.step` (Ray actors, FSDP2 ranks over gloo), the same sequences, loss and
    optimizer, with the default 2 ranks x 1 thread and with 1 rank x 2 threads;
  - the three take their steps in turn, round after round, so that the load of a shared
    machine weighs on all of them alike; ratios are medians of the per-round ratios;
  - peak: the best of a few float32 matmuls (2048^3) on all cores, before and after;
  - MFU: 6 x (parameters used per token) + attention, per trained token, over the peak.

    .venv/bin/python benchmarks/trainer.py   # writes benchmarks/results/trainer.json
"""

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from instar.config import Config
from instar.tasks.tiny_model import builtin_model
from instar.train.batch import Sequence
from instar.train.losses import sft_loss, token_logprobs
from instar.train.trainer import Trainer

SEQS, LEN, STEPS, WARMUP = 32, 256, 6, 1
CORES = os.cpu_count()


def data(vocab: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (SEQS, LEN), generator=g).tolist()
    return [Sequence(x, [False] + [True] * (LEN - 1), [0.0] * LEN) for x in ids]


def plain(path: Path, seqs: list[Sequence], micro: int) -> Callable[[], None]:
    """One step of a plain transformers loop over the same sequences, in this process."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.tensor([s.tokens for s in seqs])
    mask = torch.tensor([s.mask for s in seqs], dtype=torch.float32)
    n = int(mask.sum())

    def step():
        torch.set_num_threads(CORES)
        for i in range(0, SEQS, micro):
            logp = token_logprobs(model(input_ids=ids[i:i + micro]).logits, ids[i:i + micro], 1.0)
            sft_loss(logp, mask[i:i + micro], n)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def instar(path: Path, ranks: int, threads: int, budget: int) -> Trainer:
    cfg = Config().validate()
    cfg.train.num_ranks, cfg.train.threads_per_rank = ranks, threads
    cfg.train.micro_batch_tokens = budget
    return Trainer(cfg, str(path))


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """FLOP/s of the best of a few n^3 matmuls on all cores."""
    torch.set_num_threads(CORES)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(path: Path, length: int = LEN) -> float:
    """Training FLOPs per token of a `length`-token sequence: 6 x the weights a token
    multiplies (the embedding lookup is free, the tied output layer is not) + causal
    attention's scores and mixing. A forward alone is a third of it. MoE: a token multiplies
    top-k of the experts' weights."""
    c = AutoConfig.from_pretrained(path)
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(c)
    used = getattr(c, "num_experts_per_tok", 1) / getattr(c, "num_experts", 1)
    weights = sum(p.numel() * (used if "experts" in n else 1)
                  for n, p in model.named_parameters() if "embed_tokens" not in n)
    weights += c.vocab_size * c.hidden_size  # the output layer (tied to the embedding)
    attention = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * length / 2
    return 6 * weights + 3 * attention


def main():
    path = builtin_model("dense", "small", 0)
    seqs = data(AutoConfig.from_pretrained(path).vocab_size)
    tokens = sum(sum(s.mask) for s in seqs)  # trained tokens per step
    micro = 8  # sequences per micro-batch in both
    peak = matmul_peak()
    ray.init(num_cpus=CORES, include_dashboard=False, log_to_driver=False)
    two, one = instar(path, 2, 1, micro * LEN), instar(path, 1, CORES, micro * LEN)
    steps = {"plain": plain(path, seqs, micro), "two": lambda: two.step(seqs, "sft", 1e-4),
             "one": lambda: one.step(seqs, "sft", 1e-4)}
    times = {name: [] for name in steps}
    for r in range(WARMUP + STEPS):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if r >= WARMUP:
                times[name].append(time.perf_counter() - start)
    two.shutdown()
    one.shutdown()
    ray.shutdown()
    peak = max(peak, matmul_peak())  # before and after: the machine is shared
    plain_s, two_ranks_s, one_rank_s = (statistics.median(times[k]) for k in steps)
    ratio = {k: statistics.median(p / t for p, t in zip(times["plain"], times[k]))
             for k in ("two", "one")}
    fpt = flops_per_token(path)
    mfu = lambda s: tokens / s * fpt / peak  # noqa: E731
    result = {
        "tokens_per_s_ratio_vs_plain": round(ratio["two"], 3),
        "mfu": round(mfu(two_ranks_s), 3),
        "tokens_per_s": {"plain": round(tokens / plain_s), "instar_2_ranks_x_1_thread":
                         round(tokens / two_ranks_s), "instar_1_rank_x_2_threads":
                         round(tokens / one_rank_s)},
        "mfu_all": {"plain": round(mfu(plain_s), 3), "instar_2_ranks": round(mfu(two_ranks_s), 3),
                    "instar_1_rank": round(mfu(one_rank_s), 3)},
        "ratio_1_rank_vs_plain": round(ratio["one"], 3),
        "seconds_per_step": {k: [round(t, 2) for t in v] for k, v in times.items()},
        "matmul_peak_gflops": round(peak / 1e9, 1), "train_gflops_per_token": round(fpt / 1e9, 4),
        "setup": {"model": "built-in small dense (float32)", "sequences": SEQS, "length": LEN,
                  "micro_batch": f"{micro} sequences", "rounds_measured": STEPS,
                  "machine": f"{CORES} cores, CPU only", "date": time.strftime("%Y-%m-%d")},
    }
    out = Path(__file__).parent / "results" / "trainer.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
