"""instar on one GPU: benchmarks/bench.py's workloads scaled up, on randomly initialised
models built here, in about 8 minutes on an H100/H200-class GPU (not yet run: no GPU has
been lent to a session so far; the timings in RUNS are estimates).

    pip install -e ".[gpu]"                            # the GPU stack (PyPI vllm, CUDA torch)
    python benchmarks/gpu_bench.py                     # -> benchmarks/results/gpu_bench.json
    python benchmarks/gpu_bench.py --only grpo moe     # some runs
    .venv/bin/python benchmarks/gpu_bench.py --smoke   # the same code on CPU, tiny shapes

Models: Qwen3-0.6B-shaped (28 layers, hidden 1024, 16 query / 8 KV heads of 128, MLP 3072)
and a Qwen3-MoE shape (16 layers, hidden 1024, 32 experts of 768, top-4), both with Qwen3's
vocabulary size (151,936) and the built-in 516-token tokenizer. A random model picks the
end-of-turn token about once in 151,936 tokens, so generations run to `max_tokens`: fixed
length. agentic needs turns that end, so it starts from instar's short supervised warm-up
(the reverse task's labels), as on CPU.

One GPU: engine and trainer colocated (the engine sleeps while the trainer trains), so
`--rollout.max-staleness 0`; bfloat16 compute with float32 master weights. Reported per run:
generated and trained tokens per GPU per second, MFU of training and of generation against
the bf16 matmul peak measured here, and the loop's time split (rollout, train, sync, idle).
"""

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from bench import figures, instar_side, weights_for, write_tasks
from bench_tasks import Workload
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3MoeConfig

from instar.cluster import ray_for
from instar.tasks.tiny_model import build_tokenizer

HERE = Path(__file__).parent
VOCAB = 151_936  # Qwen3's
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072),
    "qwen3-moe": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=128, num_experts=32,
                      num_experts_per_tok=4, moe_intermediate_size=768),
}
SMOKE_SHAPES = {
    "qwen3-0.6b": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=256),
    "qwen3-moe": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=128),
}
RUNS = {  # model, workload (bfloat16); about 1.5-2 minutes each with engine start-up
    "grpo": ("qwen3-0.6b", Workload(32, 8, 512, steps=3, warmup_steps=1, dtype="bfloat16")),
    "agentic": ("qwen3-0.6b", Workload(32, 8, 64, steps=3, warmup_steps=1, turns=4,
                                       tool_latency_s=0.05, sft_steps=20, dtype="bfloat16")),
    "long": ("qwen3-0.6b", Workload(8, 4, 4096, steps=2, warmup_steps=1, dtype="bfloat16")),
    "moe": ("qwen3-moe", Workload(32, 8, 512, steps=3, warmup_steps=1, dtype="bfloat16")),
}


def build(name: str, smoke: bool, root: Path) -> Path:
    """A randomly initialised checkpoint of the named shape (seed 0) with the built-in tokenizer."""
    out = root / name
    if (out / "config.json").exists():
        return out
    tok = build_tokenizer()
    shape = (SMOKE_SHAPES if smoke else SHAPES)[name]
    cls = Qwen3MoeConfig if "num_experts" in shape else Qwen3Config
    config = cls(vocab_size=VOCAB, max_position_embeddings=40960, tie_word_embeddings=True,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                 bos_token_id=None, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def gpu_peak() -> float:
    """bf16 FLOP/s of the best of a few 8192^3 matmuls on the GPU."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a @ a
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * 8192**3 / best


def run(name: str, smoke: bool, root: Path, overrides: dict, peak: float) -> dict:
    """One workload: its model (and warm-up), the instar run, its figures."""
    shape, w = RUNS[name]
    if smoke:
        w = replace(w, prompts_per_step=2, group_size=2, max_tokens=min(w.max_tokens, 64),
                    steps=1, dtype="float32")
    start = time.perf_counter()
    model = weights_for(w, build(shape, smoke, root), overrides)
    run_root = root / name
    run_root.mkdir()
    steps, settings = instar_side(w, model, write_tasks(w, run_root)[0], run_root, overrides)
    for s in steps:
        s["idle_s"] = s["step_s"] - s["loop_step_s"]
    f = figures(steps, model, peak)
    result = {
        "model": shape, "gen_tokens_per_gpu_s": f["gen_tokens_per_s"],
        "trained_tokens_per_gpu_s": f["trained_tokens_per_s"],
        **{k: f[k] for k in ("step_s", "episodes_per_s", "mfu_train", "mfu_generate",
                             "gen_tokens_per_episode", "turns_per_episode")},
        "time_split": {k: statistics.median(s[k] for s in steps)
                       for k in ("wait_s", "train_s", "sync_s", "idle_s")},
        "wall_s_with_startup": time.perf_counter() - start,
        "workload": asdict(w), "settings": settings, "per_step": steps}
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_step", "settings")},
                     indent=1), flush=True)
    return result


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(RUNS))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, short runs: checks "
                   "the script, measures nothing")
    p.add_argument("--out", default="", help="default: benchmarks/results/gpu_bench.json "
                   "(--smoke: a temporary folder)")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    if args.smoke:
        from trainer import matmul_peak
        overrides, peak = {}, matmul_peak(torch.float32)
    else:
        overrides = {"cluster": {"device": "cuda"}, "train": {"num_ranks": 1},
                     "rollout": {"max_staleness": 0, "placement": "colocated", "gpu_memory": 0.4}}
        peak = gpu_peak()
    results = {}
    with ray_for(""):  # one Ray for every workload (a caller's, if it has one)
        for name in args.only or list(RUNS):
            results[name] = run(name, args.smoke, root, overrides, peak)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "smoke": args.smoke,
           "peak_gflops": peak / 1e9, "runs": results}
    path = Path(args.out or (root if args.smoke else HERE / "results") / "gpu_bench.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
