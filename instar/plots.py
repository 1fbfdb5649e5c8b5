"""PNG plots of a run from its metrics.jsonl: reward, eval, mismatch, staleness, step time.

    python -m instar.plots runs/<name>      # (re)draw runs/<name>/plots/*.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOTS = {  # file: (title, y label, metric names or prefixes, log scale)
    "reward": ("Training reward (mean over the step's rollouts)", "reward",
               ["rollout/reward"], False),
    "eval": ("Held-out eval", "score", ["eval/reward", "eval/pass@"], False),
    "mismatch": ("Engine vs trainer log-probs (sampled tokens) and post-sync probe",
                 "|Δ log-prob|", ["invariants/abs_logprob_diff", "invariants/sync_probe_diff"],
                 True),
    "staleness": ("Staleness of trained tokens (fraction at each lag, in versions)",
                  "fraction of tokens", ["staleness/lag_"], False),
    "time": ("Step time", "seconds", ["timing/wait_s", "timing/train_s", "timing/sync_s"], False),
}


def plot_run(run_dir: Path, prefix: str = "", out: Path | None = None) -> list[Path]:
    """The plots of run_dir/metrics.jsonl into (out or run_dir)/plots; with `prefix` (an
    adapter's lora/<name>/), of the metrics under it."""
    rows = [{k.removeprefix(prefix): v for k, v in json.loads(line).items()}
            for line in open(run_dir / "metrics.jsonl")]
    out, written = (out or run_dir) / "plots", []
    out.mkdir(exist_ok=True)
    for name, (title, ylabel, wanted, log) in PLOTS.items():
        keys = sorted({k for r in rows for k in r if any(k.startswith(w) for w in wanted)})
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        if name in ("time", "staleness"):  # stacked: where each step's time / tokens went
            if name == "time":
                keys = [k for k in wanted if k in keys]
            else:
                keys.sort(key=lambda k: int(k.rsplit("_", 1)[1]))
            steps = [r for r in rows if "rollout/reward" in r]
            ax.stackplot([r["step"] for r in steps], *[[r.get(k, 0.0) for r in steps]
                                                       for k in keys],
                         labels=[k.split("/")[1] for k in keys])
        else:
            for k in keys:
                pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), int | float)]
                ax.plot(*zip(*pts), label=k, marker="o" if len(pts) < 20 else None)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if log:
            ax.set_yscale("symlog", linthresh=1e-8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(out / f"{name}.png")
    return written


if __name__ == "__main__":
    print("\n".join(str(p) for p in plot_run(Path(sys.argv[1]))))
