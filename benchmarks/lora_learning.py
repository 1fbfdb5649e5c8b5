"""LoRA RL learning runs on the reverse job (tiny built-in model, `--data.task reverse`, 150
steps), one per learning rate, and the full-weights default beside them: each an `instar rl` run of its
own, one after another. Writes benchmarks/results/lora_learning.json (each run's summary and
command) and docs/images/lora_learning.png (train reward, 10-step running mean).

    .venv/bin/python benchmarks/lora_learning.py [RUNS_DIR]   # about 15 minutes on 2 cores

A run whose RUNS_DIR/<name>/summary.json exists is read, not run again.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).parents[1]
RUNS = {  # name: flags on top of the reverse job
    "full": [],
    "lr1e-3": ["--lora.rank", "8", "--lora.alpha", "16", "--train.lr", "1e-3"],
    "lr3e-3": ["--lora.rank", "8", "--lora.alpha", "16", "--train.lr", "3e-3"],
    "lr1e-2": ["--lora.rank", "8", "--lora.alpha", "16", "--train.lr", "1e-2"],
    "lr3e-2": ["--lora.rank", "8", "--lora.alpha", "16", "--train.lr", "3e-2"],
    "r32lr3e-3": ["--lora.rank", "32", "--lora.alpha", "64", "--train.lr", "3e-3"],
}


def main(runs: Path) -> None:
    result = {}
    for name, flags in RUNS.items():
        command = ["instar", "rl", "--data.task", "reverse", *flags, "--logging.root", str(runs),
                   "--logging.name", name]
        if not (runs / name / "summary.json").exists():
            subprocess.run([str(ROOT / ".venv/bin/instar"), *command[1:]], check=True,
                           stdout=subprocess.DEVNULL)
        summary = json.loads((runs / name / "summary.json").read_text())
        lines = [json.loads(x) for x in (runs / name / "metrics.jsonl").open()]
        reward = [m["rollout/reward"] for m in lines if "rollout/reward" in m]
        times = [m["time"] for m in lines]
        result[name] = {"command": " ".join(command[:-4]),
                        **{k: summary[k] for k in ("eval_reward_before", "eval_reward_after",
                                                   "reward_first_steps_mean",
                                                   "reward_last_steps_mean")},
                        "wall_s": round(times[-1] - times[0]), "reward": reward}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in result.items():
        w = r["reward"]
        smooth = [sum(w[max(0, i - 9):i + 1]) / len(w[max(0, i - 9):i + 1]) for i in range(len(w))]
        ax.plot(range(1, len(w) + 1), smooth, label=f"{name}: eval {r['eval_reward_before']:.2f}"
                f" → {r['eval_reward_after']:.2f}", lw=2.2 if name == "full" else 1.4)
    ax.set(xlabel="step", ylabel="train reward (10-step mean)",
           title="Default job: full weights against LoRA (rank 8 unless named)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    (ROOT / "docs" / "images").mkdir(exist_ok=True)
    fig.savefig(ROOT / "docs" / "images" / "lora_learning.png", dpi=100)
    for r in result.values():
        r["reward"] = [round(x, 4) for x in r["reward"]]
    result["setup"] = {"machine": "2 cores, CPU only", "date": time.strftime("%Y-%m-%d"),
                       "note": "each run alone on the machine, one after another"}
    out = ROOT / "benchmarks" / "results" / "lora_learning.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/lora_learning").absolute())
