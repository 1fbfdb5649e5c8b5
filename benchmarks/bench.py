"""instar against TRL's GRPOTrainer, side by side in one invocation, and both against this
machine's matmul peak measured in the same run.

    .venv/bin/python benchmarks/bench.py --quick            # every workload, reduced (< 10 min)
    .venv/bin/python benchmarks/bench.py                    # the full run
    .venv/bin/python benchmarks/bench.py --only agentic     # some workloads

Writes benchmarks/results/bench.json and bench.md (with --quick, in benchmarks/results/quick/).
The workloads (benchmarks/bench_tasks.py): grpo-small (16 prompts x 8 samples, up to 128 new
tokens; float32, and bfloat16 as grpo-small-bf16), agentic (4 model turns, a 50 ms tool call
after each), agentic-tail (1-8 model turns per episode, log-normal tool latencies with a
median of 0.3 s and a p99 of 5 s; both sides draw the same turns and latencies for the same
task and sample), long (4 x 4 samples, 1024 new tokens each: generation does not stop at
end-of-turn tokens). For each, both sides start from the same weights folder (the built-in
small model, ~24M parameters; agentic, agentic-tail: the same after instar's cached
supervised warm-up, so that turns end and episodes go on), take the same prompts in the same
order, sample as many completions with the same temperature and token limits, and train with
the same AdamW settings and precision. Each side has the whole machine in turn; steps after
the warm-up steps are measured. The sides alternate, `--rounds` times each (instar, TRL,
instar, TRL: default 2, with --quick 1), and the figures pool every round's measured steps,
so a slow spell of the machine falls on both sides.

TRL is not a dependency of instar. It runs in a subprocess (benchmarks/bench_trl.py) with
this folder on PYTHONPATH, installed beside the venv without touching its packages:

    .venv/bin/pip install --target /tmp/trl-site --no-deps trl==1.16.0 accelerate==1.16.0 \\
        datasets==4.8.5 pandas pyarrow==24.0.0 xxhash 'multiprocess<0.70.20'

(`--trl-site DIR` for another folder; datasets 5.2 fails here: its fingerprinting cannot pickle
a pyarrow table.)

Figures, per side, over the measured steps:
  - step_s: wall seconds per optimizer step (median, min, max);
  - gen_tokens_per_s: generated tokens / wall seconds;
  - trained_tokens_per_s: tokens through the training forward and backward (prompt, generated
    and tool-result tokens) / wall seconds;
  - episodes_per_s;
  - mfu_train, mfu_generate: model FLOPs of the update (3 forwards' worth) and of generation
    (one forward over each sequence) per wall second, over the matmul peak in the workload's
    dtype. 1 / (mfu_train + mfu_generate) is the step time over the step's FLOP lower bound
    (`step_over_flop_bound`);
  - time split: instar's loop timing (rollout wait, train, weight sync) and idle (the rest of
    the wall time between steps: logging, engine stats); TRL's rollout (generation, tools,
    rewards) and train.
`ratio` is instar / TRL for every figure (for step_s lower is better).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from bench_tasks import QUICK, WORKLOADS, Workload, tool_result
from trainer import flops_per_token, matmul_peak
from transformers import AutoTokenizer

from instar.agents.chat import as_messages, continuation_ids, prompt_ids
from instar.agents.loading import load_tasks
from instar.cli import main as instar
from instar.cluster import ray_for
from instar.config import Config
from instar.inputs import task_order
from instar.tasks.reverse_data import reverse_data
from instar.tasks.tiny_model import builtin_model
from instar.train.sft import label_rows, warmup

HERE = Path(__file__).parent
TRL_INSTALL = ("pip install --target /tmp/trl-site --no-deps trl==1.16.0 accelerate==1.16.0 "
               "datasets==4.8.5 pandas pyarrow==24.0.0 xxhash 'multiprocess<0.70.20'")


def configure(cfg: Config, overrides: dict[str, dict] | None) -> Config:
    """Set config fields from {section: {field: value}}."""
    for section, values in (overrides or {}).items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return cfg


def weights_for(w: Workload, base: Path, overrides: dict | None = None) -> Path:
    """`base`; with `sft_steps`, instar's cached warm-up of it on the reverse task's labels
    (short answers that end their turn)."""
    if not w.sft_steps:
        return base
    cfg = configure(Config(), overrides)
    cfg.data.task, cfg.data.train = "reverse", reverse_data()[0]
    cfg.train.warmup_sft_steps, cfg.logging.progress = w.sft_steps, False
    cfg.validate()
    with ray_for(""):
        return warmup(cfg, base, label_rows(load_tasks(cfg.data.train)),
                      AutoTokenizer.from_pretrained(base))


def write_tasks(w: Workload, folder: Path) -> tuple[Path, Path]:
    """The run's tasks (instar's file; instar shuffles it by seed) and the same tasks in the
    order instar's steps take them (TRL's file; TRL keeps the order)."""
    n = (w.warmup_steps + w.steps) * w.prompts_per_step
    rows = [json.loads(x) for x in open(reverse_data()[0])][:n]
    ours, theirs = folder / "tasks.jsonl", folder / "tasks_in_step_order.jsonl"
    ours.write_text("".join(json.dumps(r) + "\n" for r in rows))
    at = task_order(load_tasks(str(ours)), 0)
    by_id = {r["id"]: r for r in rows}
    theirs.write_text("".join(json.dumps(by_id[at(t).id]) + "\n" for t in range(n)))
    return ours, theirs


def obs_tokens(tok, s: str) -> int:
    """Tokens of the tool result that follows a turn on string `s`."""
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    return len(continuation_ids(tok, before, before + tool_result(s), None, True))


def instar_side(w: Workload, model: Path, tasks: Path, root: Path,
                overrides: dict | None = None) -> tuple[list[dict], dict]:
    cfg = configure(Config(), overrides)
    cfg.model.path, cfg.model.dtype = str(model), w.dtype
    cfg.data.train, cfg.data.prompts_per_step = str(tasks), w.prompts_per_step
    cfg.agent.file = f"{HERE / 'bench_tasks.py'}:{w.agent}"
    if w.turns > 1:
        cfg.agent.config = {k: str(v) for k, v in w.plan.items()}
    r = cfg.rollout
    r.group_size, r.max_tokens, r.max_model_len = w.group_size, w.max_tokens, 512 + w.max_tokens * w.turns
    r.ignore_eos = w.fixed_length
    r.preflight = 0  # a correctness check before step 1, not part of a step
    if w.dtype == "bfloat16":
        r.sync_check_tol = 5e-2
    cfg.train.steps, cfg.train.warmup_sft_steps, cfg.train.lr = w.warmup_steps + w.steps, 0, w.lr
    cfg.eval.size, cfg.checkpoint.save_final = 0, False
    cfg.logging.progress = cfg.logging.plots = cfg.logging.tensorboard = False
    cfg.logging.root, cfg.logging.name = str(root), "instar"
    (root / "recipe.yaml").write_text(cfg.to_yaml())
    instar(["rl", "--config", str(root / "recipe.yaml")])
    lines = [json.loads(x) for x in (root / "instar" / "metrics.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model)
    prompt_len = {t.id: len(prompt_ids(tok, as_messages(t.prompt), None))
                  for t in load_tasks(str(tasks))}
    obs_len = statistics.mean(obs_tokens(tok, t) for t in prompt_len)  # (instar logs no count)
    steps = []
    for k, m in enumerate(lines):
        episodes = w.prompts_per_step * w.group_size - m["rollout/failed"]
        extra = episodes * (m.get("rollout/info/turns", 1) - 1) * obs_len
        steps.append({
            "step_s": m["time"] - lines[k - 1]["time"] if k else None,  # wall, between lines
            "wait_s": m["timing/wait_s"], "train_s": m["timing/train_s"],
            "sync_s": m["timing/sync_s"], "loop_step_s": m["timing/step_s"],
            "gen_tokens": m["rollout/gen_tokens"], "episodes": episodes,
            "trained_tokens": w.group_size * sum(prompt_len[p] for p in m["prompts"])
            + m["rollout/gen_tokens"] + extra,
            "turns": m.get("rollout/info/turns", 1), "tool_s": m.get("rollout/info/tool_s", 0.0),
            "prompts": m["prompts"]})
    settings = {k: asdict(cfg)[g][k] for g, keys in {
        "model": ["dtype"], "rollout": ["group_size", "max_tokens", "ignore_eos", "temperature",
                                        "max_staleness", "threads", "num_engines", "partial",
                                        "placement", "transport"],
        "cluster": ["device"], "train": ["num_ranks", "threads_per_rank", "lr", "weight_decay", "grad_clip",
                  "micro_batch_tokens", "master_dtype", "activation_checkpointing"],
        "algo": ["estimator", "policy_loss", "aggregation", "clip_low", "clip_high",
                 "kl_coef"]}.items() for k in keys}
    settings["optimizer"] = "torch.optim.AdamW (betas 0.9/0.999, eps 1e-8), constant lr"
    return steps[w.warmup_steps:], settings


def trl_side(w: Workload, model: Path, tasks: Path, root: Path, site: str) -> tuple[list[dict], dict]:
    spec, out = root / "trl_spec.json", root / "trl_steps.json"
    spec.write_text(json.dumps({"workload": asdict(w), "model": str(model), "tasks": str(tasks)}))
    env = {**os.environ, "PYTHONPATH": site, "TRL_EXPERIMENTAL_SILENCE": "1"}
    with open(root / "trl.log", "w") as log:
        done = subprocess.run([sys.executable, str(HERE / "bench_trl.py"), str(spec), str(out)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"the TRL side failed; its output is in {root / 'trl.log'}")
    result = json.loads(out.read_text())
    return result["steps"][w.warmup_steps:], result["settings"]


def figures(steps: list[dict], model: Path, peak: float) -> dict:
    wall = sum(s["step_s"] for s in steps)
    seqs = sum(s["episodes"] for s in steps)
    length = sum(s["trained_tokens"] for s in steps) / seqs  # mean tokens per sequence
    train_flops = seqs * length * flops_per_token(model, round(length))
    mfu_train, mfu_generate = train_flops / wall / peak, train_flops / 3 / wall / peak
    times = [s["step_s"] for s in steps]
    return {
        "step_s": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "gen_tokens_per_s": sum(s["gen_tokens"] for s in steps) / wall,
        "trained_tokens_per_s": sum(s["trained_tokens"] for s in steps) / wall,
        "episodes_per_s": seqs / wall, "mfu_train": mfu_train, "mfu_generate": mfu_generate,
        "step_over_flop_bound": 1 / (mfu_train + mfu_generate),
        "gen_tokens_per_episode": sum(s["gen_tokens"] for s in steps) / seqs,
        "turns_per_episode": statistics.mean(s["turns"] for s in steps),
    }


def time_split(steps: list[dict], keys: list[str]) -> dict:
    return {k: statistics.median(s[k] for s in steps) for k in keys}


def compare(name: str, w: Workload, root: Path, site: str, size: str, rounds: int) -> dict:
    """Both sides' measured steps, pooled over `rounds` runs each (instar, TRL, instar, TRL,
    ...; each step records its `round`), and their settings."""
    assert w.warmup_steps >= 1, "the first step has no previous one to time it from"
    model = weights_for(w, builtin_model("dense", size, 0))
    ours, theirs = write_tasks(w, root)
    instar_steps, trl_steps = [], []
    for r in range(rounds):
        folder = root / f"round-{r}"
        folder.mkdir()
        t0 = time.perf_counter()
        steps, instar_settings = instar_side(w, model, ours, folder)
        instar_steps += [{**s, "round": r} for s in steps]
        t1 = time.perf_counter()
        steps, trl_settings = trl_side(w, model, theirs, folder, site)
        trl_steps += [{**s, "round": r} for s in steps]
        print(f"[{name}] round {r + 1}/{rounds}: instar {t1 - t0:.0f} s, TRL "
              f"{time.perf_counter() - t1:.0f} s (wall, start-up included)", flush=True)
    for s in instar_steps:
        s["idle_s"] = s["step_s"] - s["loop_step_s"]
    for s in trl_steps:
        s["train_s"], s["episodes"] = s["step_s"] - s["rollout_s"], s["seqs"]
    return {"same_prompts_in_order": [s["prompts"] for s in instar_steps] ==
            [s["prompts"] for s in trl_steps], "rounds": rounds,
            "settings": {"workload": asdict(w), "weights": str(model), "instar": instar_settings,
                         "trl": trl_settings},
            "per_step": {"instar": instar_steps, "trl": trl_steps}}


def summarise(raw: dict, peak: float) -> dict:
    steps, model = raw["per_step"], Path(raw["settings"]["weights"])
    a, b = figures(steps["instar"], model, peak), figures(steps["trl"], model, peak)
    out = {}
    for k in a:
        x, y = (a[k]["median"], b[k]["median"]) if k == "step_s" else (a[k], b[k])
        out[k] = {"instar": a[k], "trl": b[k], "ratio": x / y}
    out["time_split"] = {"instar": time_split(steps["instar"], ["wait_s", "train_s", "sync_s",
                                                                "idle_s"]),
                         "trl": time_split(steps["trl"], ["rollout_s", "train_s"])}
    return {**out, **raw}


def machine() -> dict:
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), platform.processor())
    mem = next(int(x.split()[1]) for x in open("/proc/meminfo") if x.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**20, 1),
            "gpu": "none", "torch": torch.__version__, "python": platform.python_version()}


def markdown(result: dict) -> str:
    def f(x, digits=1):
        return f"{x:.{digits}f}" if isinstance(x, float) else str(x)
    rows = ["| workload | side | s/step median (min-max) | gen tok/s | trained tok/s | episodes/s "
            "| MFU train | MFU gen | step / FLOP bound | time split (median s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["workloads"].items():
        for side in ("instar", "trl", "ratio"):
            st = r["step_s"][side]
            split = r["time_split"].get(side, {})
            rows.append(" | ".join([
                f"| {name}", "instar / TRL" if side == "ratio" else side,
                f(st, 2) if side == "ratio" else f"{st['median']:.2f} ({st['min']:.2f}-{st['max']:.2f})",
                *(f(r[k][side], 2 if side == "ratio" else 0) for k in
                  ("gen_tokens_per_s", "trained_tokens_per_s")),
                f(r["episodes_per_s"][side], 2),
                *(f(r[k][side], 3 if side != "ratio" else 2) for k in ("mfu_train", "mfu_generate")),
                f(r["step_over_flop_bound"][side], 2),
                ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in split.items()) + " |"]))
    m = result["machine"]
    lines = [f"# instar vs TRL ({result['date']}{', --quick' if result['quick'] else ''})", "",
             f"`{result['command']}`: {result['wall_s'] / 60:.1f} min"
             + ("" if result["final"] else " so far (unfinished: partial results)"), "", *rows, "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU; torch "
             f"{m['torch']}. Load average (1 min) before/after: {result['load_before']} / "
             f"{result['load_after']}. Matmul peak measured in this run (2048^3, all cores): "
             f"{result['peak_gflops']['float32']:.0f} GFLOP/s float32, "
             f"{result['peak_gflops']['bfloat16']:.0f} GFLOP/s bfloat16.", "",
             "Ratios are instar / TRL (for s/step lower is better). MFU: model FLOPs per wall "
             "second over the peak (training: 3 forwards; generation: one forward over each "
             "sequence); step / FLOP bound = 1 / (MFU train + MFU gen). instar's split: wait "
             "(for rollouts), train, sync, idle (between steps); TRL's: rollout, train.", "",
             "## Settings", ""]
    for name, r in result["workloads"].items():
        s = r["settings"]
        lines += [f"### {name}", "", f"- workload: `{json.dumps(s['workload'])}`",
                  f"- weights: `{s['weights']}`",
                  f"- same prompts in the same order on both sides: {r['same_prompts_in_order']}",
                  f"- rounds (instar, TRL, instar, TRL, ...): {r['rounds']}; measured "
                  f"steps pooled per side: {len(r['per_step']['instar'])} instar, "
                  f"{len(r['per_step']['trl'])} TRL",
                  f"- instar: `{json.dumps(s['instar'])}`", f"- TRL: `{json.dumps(s['trl'])}`", ""]
    lines += ["TRL on CPU: `GRPOTrainer`, generation by transformers `generate` on the policy "
              "(TRL's default, `use_vllm=False`: its vLLM modes need a CUDA device or a separate "
              "server). agentic, agentic-tail: `GRPOTrainer(rollout_func=...)` (TRL's custom-rollout "
              "hook): each turn generates all live episodes in one batch with the trainer's own "
              "generation, runs every complete turn's tool call concurrently (TRL's built-in "
              "`tools=` loop would await them one episode after another), appends the tool "
              "result with instar's chat-template continuation and masks it out of the loss; a "
              "turn cut off at the token limit ends the episode, as in instar. Each episode's "
              "turn count and tool latencies are drawn from a seed of (task id, sample index), "
              "the same on both sides (bench_tasks.episode_plan).", "",
              f"TRL install (beside the venv, not a dependency of instar): `{TRL_INSTALL}`", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced workloads (< 10 min in all)")
    p.add_argument("--only", nargs="+", choices=list(WORKLOADS), help="run only these workloads")
    p.add_argument("--trl-site", default="/tmp/trl-site", help="folder TRL is installed in")
    p.add_argument("--rounds", type=int, help="runs of each side per workload, alternating "
                   "(instar, TRL, instar, TRL, ...), their measured steps pooled (default 2, "
                   "with --quick 1)")
    p.add_argument("--size", default="small", choices=["small", "tiny"],
                   help="built-in model size (tiny: a smoke test of the harness, not a benchmark)")
    p.add_argument("--out", help="folder for bench.json/bench.md (default: benchmarks/results, "
                   "with --quick benchmarks/results/quick)")
    args = p.parse_args()
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 2
    if rounds < 1:
        p.error("--rounds must be at least 1")
    check = subprocess.run([sys.executable, "-c", "import trl"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": args.trl_site})
    if check.returncode:
        sys.exit(f"TRL is not importable from {args.trl_site}; install it there: {TRL_INSTALL}")
    table = QUICK if args.quick else WORKLOADS
    load_before = os.getloadavg()[0]
    fp32, bf16 = matmul_peak(torch.float32), matmul_peak(torch.bfloat16, 256)
    native_bf16 = bf16 > fp32 / 4  # a small probe: emulated bf16 is ~100x slower
    size = {"float32": 2048, "bfloat16": 2048 if native_bf16 else 256}
    if not native_bf16:
        print(f"bfloat16 matmul runs at {bf16 / 1e9:.1f} GFLOP/s here (no native bf16 on this "
              "CPU): the bfloat16 workloads run only when named in --only")
    names = args.only or [n for n in table if native_bf16 or table[n].dtype != "bfloat16"]
    peaks = {"float32": fp32, "bfloat16": matmul_peak(torch.bfloat16) if native_bf16 else bf16}
    start, raw = time.perf_counter(), {}

    def write(final: bool) -> str:
        workloads = {name: summarise(r, peaks[r["settings"]["workload"]["dtype"]])
                     for name, r in raw.items()}
        result = {"date": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick, "final": final,
                  "command": " ".join([".venv/bin/python benchmarks/bench.py", *sys.argv[1:]]),
                  "wall_s": time.perf_counter() - start, "machine": machine(),
                  "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                  "peak_gflops": {k: v / 1e9 for k, v in peaks.items()}, "workloads": workloads}
        out = Path(args.out or HERE / "results" / ("quick" if args.quick else ""))
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "bench.md").write_text(markdown(result))
        return markdown(result)

    for name in names:  # the results so far are written after each workload
        raw[name] = compare(name, table[name], Path(tempfile.mkdtemp(prefix=f"bench-{name}-")),
                            args.trl_site, args.size, rounds)
        write(final=False)
    for dtype in peaks:  # the best of before and after: the machine may be shared
        peaks[dtype] = max(peaks[dtype], matmul_peak(getattr(torch, dtype), size[dtype]))
    print(write(final=True))

if __name__ == "__main__":
    main()
