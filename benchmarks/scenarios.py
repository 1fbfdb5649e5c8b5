"""Learning runs of the built-in scenarios on this machine: each scenario's held-out figure
before and after its run. Writes benchmarks/results/scenarios.json (under `scenarios`, one
entry per scenario: `eval_before`, `eval_after`, `wall_s`, `command`, and what the run
measured on the way) and docs/images/scenario_<name>.png (its training and eval curves).

    .venv/bin/python benchmarks/scenarios.py [RUNS_DIR] [SCENARIO ...]   # tool_use: ~15 min

Scenarios not yet run here keep `null` (code_exec, vision, judge, distill: issue 26). A stage
whose output exists in RUNS_DIR is read, not run again (its wall time is then the logged
one). Run it with nothing else on the machine: the wall times are the point.
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
INSTAR = str(ROOT / ".venv" / "bin" / "instar")
RESULTS = ROOT / "benchmarks" / "results" / "scenarios.json"


def stage(runs: Path, name: str, args: list[str], done: str) -> float:
    """Run `instar ARGS` as run `name` under `runs` unless its `done` file exists; its wall
    seconds (kept in the run's wall_s.txt, so a stage read back reports its own)."""
    if not (runs / name / done).exists():
        start = time.time()
        subprocess.run(["nice", "-n", "10", INSTAR, *args, "--logging.root", str(runs),
                        "--logging.name", name], check=True, stdout=subprocess.DEVNULL)
        (runs / name / "wall_s.txt").write_text(f"{time.time() - start:.1f}\n")
    return float((runs / name / "wall_s.txt").read_text())


def metrics(runs: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (runs / name / "metrics.jsonl").open()]


def tool_use(runs: Path) -> dict:
    """Multi-turn tool use (lookup + calculator), tiny model, one-digit fact values: the base
    model's held-out reward, then SFT on the demonstrations, then GRPO."""
    from instar.tasks.tiny_model import builtin_model
    from instar.tasks.tool_use_data import tool_use_data

    train, held_out, demos = tool_use_data(digits=1)
    agent = ["--agent", "instar/tasks/tool_use.py"]
    evals = ["--data.eval", held_out, "--eval.size", "64", "--rollout.max-tokens", "80",
             "--rollout.max-model-len", "1024"]
    stages = {
        "tool-base-eval": (["eval", *agent, "--model.path", str(builtin_model()), *evals],
                           "eval.json"),
        "tool-sft": (["sft", "--data.train", demos, "--train.steps", "500", "--train.lr", "3e-3",
                      "--data.prompts-per-step", "16", "--eval.size", "0"], "final"),
        "tool-rl": (["rl", *agent, "--model.path", str(runs / "tool-sft" / "final"),
                     "--data.train", train, *evals, "--train.warmup-sft-steps", "0",
                     "--train.steps", "20", "--train.lr", "1e-4", "--data.prompts-per-step", "8",
                     "--rollout.group-size", "4"], "summary.json")}
    wall = {name: stage(runs, name, args, done) for name, (args, done) in stages.items()}
    base = json.loads((runs / "tool-base-eval" / "eval.json").read_text())
    sft, rl = metrics(runs, "tool-sft"), metrics(runs, "tool-rl")
    summary = json.loads((runs / "tool-rl" / "summary.json").read_text())
    result = {
        "eval_before": base["eval/reward"], "eval_after_sft": summary["eval_reward_before"],
        "eval_after": summary["eval_reward_after"], "wall_s": round(sum(wall.values())),
        "stage_wall_s": {k: round(v) for k, v in wall.items()},
        "command": "python benchmarks/scenarios.py RUNS tool_use  # = python -m "
                   "instar.tasks.tool_use_data --digits 1, then: "
                   + " ; ".join("instar " + " ".join(a) for a, _ in stages.values()),
        "sft_loss": [round(m["train/loss"], 4) for m in sft if "train/loss" in m],
        "rl_reward": [round(m["rollout/reward"], 4) for m in rl if "rollout/reward" in m]}
    plot("tool_use", result, "Tool use (tiny model, one-digit facts): SFT, then GRPO")
    return result


def plot(name: str, r: dict, title: str) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.plot(range(1, len(r["sft_loss"]) + 1), r["sft_loss"])
    a.set(xlabel="SFT step", ylabel="assistant-token loss", yscale="log", title="SFT")
    b.plot(range(1, len(r["rl_reward"]) + 1), r["rl_reward"], label="train reward")
    n = len(r["rl_reward"])
    b.plot([0, n], [r["eval_after_sft"], r["eval_after"]], "o--",
           label=f"held-out: base {r['eval_before']:.2f}, after SFT {r['eval_after_sft']:.2f},"
                 f" after RL {r['eval_after']:.2f}")
    b.set(xlabel="RL step", ylabel="reward", ylim=(0, 1.05), title="GRPO")
    b.legend(fontsize=7, loc="lower right")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    (ROOT / "docs" / "images").mkdir(exist_ok=True)
    fig.savefig(ROOT / "docs" / "images" / f"scenario_{name}.png", dpi=100)


SCENARIOS = {"tool_use": tool_use, "code_exec": None, "vision": None, "judge": None,
             "distill": None}


def main(runs: Path, names: list[str]) -> None:
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        sys.exit(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    old = json.loads(RESULTS.read_text())["scenarios"] if RESULTS.exists() else {}
    out = {n: old.get(n) for n in SCENARIOS}
    for n in names or [n for n, run in SCENARIOS.items() if run]:
        if SCENARIOS[n] is None:
            sys.exit(f"scenario {n!r} has no measured run yet")
        out[n] = SCENARIOS[n](runs / n)
    RESULTS.write_text(json.dumps({
        "setup": {"machine": "2 cores, CPU only", "date": time.strftime("%Y-%m-%d")},
        "scenarios": out}, indent=1) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0] if args else "/tmp/scenarios").absolute(), args[1:])
