"""Learning runs of the built-in scenarios on this machine: each scenario's held-out figure
before and after its run. Writes benchmarks/results/scenarios.json (under `scenarios`, one
entry per scenario: `eval_before`, `eval_after`, `wall_s`, `command`, and what the run
measured on the way) and docs/images/scenario_<name>.png (its training and eval curves).

    .venv/bin/python benchmarks/scenarios.py [RUNS_DIR] [SCENARIO ...]

A scenario is a short list of `instar` commands (its stages), run one after another. A stage
whose output exists in RUNS_DIR is read, not run again (its wall time is then the one it
logged). Run it with nothing else on the machine: the wall times are the point.
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


def run_stages(runs: Path, stages: dict[str, tuple[list[str], str]]) -> dict[str, float]:
    """Run each stage `name: (instar args, the file it leaves when done)` as run `name`
    under `runs`, unless that file exists; the stages' wall seconds (kept in each run's
    wall_s.txt, so a stage read back reports its own; load.txt keeps the machine's load
    averages over the last 1, 5 and 15 minutes as it ended)."""
    wall = {}
    for name, (args, done) in stages.items():
        if not (runs / name / done).exists():
            start = time.time()
            subprocess.run([INSTAR, *args, "--logging.root", str(runs), "--logging.name", name,
                            "--logging.no-progress"], check=True, stdout=subprocess.DEVNULL)
            (runs / name / "wall_s.txt").write_text(f"{time.time() - start:.1f}\n")
            (runs / name / "load.txt").write_text(Path("/proc/loadavg").read_text())
        wall[name] = float((runs / name / "wall_s.txt").read_text())
    return wall


def loads(runs: Path, stages: dict) -> dict[str, str | None]:
    """Each stage's load averages (1, 5, 15 min) as it ended; None if not recorded."""
    files = {name: runs / name / "load.txt" for name in stages}
    return {n: " ".join(f.read_text().split()[:3]) if f.exists() else None
            for n, f in files.items()}


def command(name: str, runs: Path, stages: dict[str, tuple[list[str], str]]) -> str:
    """The scenario's one command, and the instar commands it runs (RUNS: the folder of
    all scenarios' runs; CACHE: instar's cache, where the built-in models and data are written)."""
    from instar.tasks.tiny_model import cache_root

    text = " ; ".join("instar " + " ".join(args) for args, _ in stages.values())
    return (f"python benchmarks/scenarios.py RUNS {name}  # runs: "
            + text.replace(str(runs.parent), "RUNS").replace(str(cache_root()), "CACHE"))


def metrics(runs: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (runs / name / "metrics.jsonl").open()]


def series(rows: list[dict], key: str) -> list[float]:
    return [round(m[key], 4) for m in rows if key in m]


def read(runs: Path, name: str, file: str) -> dict:
    return json.loads((runs / name / file).read_text())


def sft_then_rl(name: str, runs: Path, stages: dict, title: str, reward: str = "reward") -> dict:
    """Run a scenario of three stages (`P-base-eval`, `P-sft`, `P-rl` in this order, and any
    after them), its result and its plot: the held-out figure of the start model, after SFT
    (the RL run's first eval) and after RL."""
    wall = run_stages(runs, stages)
    base, sft, rl = list(stages)[:3]
    summary, steps = read(runs, rl, "summary.json"), metrics(runs, rl)
    r = {"eval_before": read(runs, base, "eval.json")["eval/reward"],
         "eval_after_sft": summary["eval_reward_before"], "eval_after": summary["eval_reward_after"],
         "wall_s": round(sum(wall.values())), "stage_wall_s": {k: round(v) for k, v in wall.items()},
         "command": command(name, runs, stages), "stage_load": loads(runs, stages),
         "sft_loss": series(metrics(runs, sft), "train/loss"),
         "rl_reward": series(steps, "rollout/reward")}
    plot(name, title, [
        ("SFT", "SFT step", "assistant-token loss", {"loss": r["sft_loss"]}, True),
        ("GRPO", "RL step", reward, {"train reward": r["rl_reward"]}, False)], r)
    return r


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
    return sft_then_rl("tool_use", runs, stages,
                       "Tool use (tiny model, one-digit facts): SFT, then GRPO")


def code_exec(runs: Path) -> dict:
    """Code execution with test feedback, two attempts (the task's default), tiny model: the
    base model's held-out pass rate, SFT on the demonstrations (a quarter of them a wrong
    first attempt, the task's report on it, then the fix), GRPO; last, the final model with
    one attempt."""
    from instar.tasks.code_exec_data import code_exec_data, code_exec_demos
    from instar.tasks.tiny_model import builtin_model

    train, held_out = code_exec_data()
    demos = code_exec_demos()
    agent = ["--agent", "instar/tasks/code_exec.py"]
    evals = ["--data.eval", held_out, "--eval.size", "32", "--eval.samples", "4",
             "--rollout.max-tokens", "48", "--rollout.max-model-len", "1024"]
    stages = {
        "code-base-eval": (["eval", *agent, "--model.path", str(builtin_model()), *evals],
                           "eval.json"),
        "code-sft": (["sft", "--data.train", demos, "--train.steps", "400", "--train.lr", "3e-3",
                      "--data.prompts-per-step", "16", "--eval.size", "0"], "final"),
        "code-rl": (["rl", *agent, "--model.path", str(runs / "code-sft" / "final"),
                     "--data.train", train, *evals, "--train.warmup-sft-steps", "0",
                     "--train.steps", "20", "--train.lr", "2e-4", "--data.prompts-per-step", "8",
                     "--rollout.group-size", "8"], "summary.json"),
        "code-one-attempt-eval": (["eval", *agent, "--agent.max-turns", "1", "--model.path",
                                   str(runs / "code-rl" / "final"), *evals], "eval.json")}
    r = sft_then_rl("code_exec", runs, stages,
                    "Code execution, two attempts (tiny model): SFT, then GRPO", "pass rate")
    r["eval_after_one_attempt"] = read(runs, "code-one-attempt-eval", "eval.json")["eval/reward"]
    r["rl_attempts"] = series(metrics(runs, "code-rl"), "rollout/info/attempts")
    return r



def vision(runs: Path) -> dict:
    """Vision-language (the colour of a shape, an image per turn), tiny Qwen2-VL: the base
    model's held-out reward, SFT on image conversations, then GRPO."""
    from instar.tasks.shapes_data import shapes_data

    train, held_out, demos = shapes_data()
    agent = ["--agent", "instar/tasks/shapes.py"]
    evals = ["--data.eval", held_out, "--eval.size", "32", "--eval.samples", "4",
             "--rollout.max-tokens", "8"]
    stages = {
        "vision-base-eval": (["eval", *agent, "--model.kind", "vl", *evals], "eval.json"),
        "vision-sft": (["sft", "--model.kind", "vl", "--data.train", demos, "--train.steps", "400",
                        "--train.lr", "3e-3", "--data.prompts-per-step", "16", "--eval.size", "0"],
                       "final"),
        "vision-rl": (["rl", *agent, "--model.path", str(runs / "vision-sft" / "final"),
                       "--data.train", train, *evals, "--train.warmup-sft-steps", "0",
                       "--train.steps", "30", "--train.lr", "1e-4", "--data.prompts-per-step", "8",
                       "--rollout.group-size", "8"], "summary.json")}
    return sft_then_rl("vision", runs, stages,
                       "Vision-language (tiny Qwen2-VL, shapes): SFT on images, then GRPO")


def distill(runs: Path) -> dict:
    """On-policy distillation on the reverse task: the teacher is the reverse job's model
    (tiny, warm-up + 150 GRPO steps); the student, a tiny model of another seed after the
    same warm-up, learns from the teacher's per-token log-probs on its own samples."""
    stages = {
        "distill-teacher": (["rl", "--data.task", "reverse"], "summary.json"),
        "distill-student": (["rl", "--data.task", "reverse", "--model.seed", "1",
                             "--algo.estimator", "on_policy_distill",
                             "--algo.teacher", str(runs / "distill-teacher" / "final"),
                             "--train.steps", "120", "--train.lr", "2e-3"], "summary.json")}
    wall = run_stages(runs, stages)
    student, steps = read(runs, "distill-student", "summary.json"), metrics(runs, "distill-student")
    kl = series(steps, "train/teacher_kl")
    r = {"eval_before": student["eval_reward_before"], "eval_after": student["eval_reward_after"],
         "teacher_eval": read(runs, "distill-teacher", "summary.json")["eval_reward_after"],
         "teacher_kl_first_10": round(sum(kl[:10]) / 10, 3),
         "teacher_kl_last_10": round(sum(kl[-10:]) / 10, 3),
         "wall_s": round(sum(wall.values())), "stage_wall_s": {k: round(v) for k, v in wall.items()},
         "command": command("distill", runs, stages), "stage_load": loads(runs, stages),
         "teacher_kl": kl,
         "reward": series(steps, "rollout/reward")}
    r["eval_after_sft"] = r["eval_before"]  # (the plot's start point: the distillation's)
    plot("distill", "On-policy distillation (reverse task): tiny student, tiny teacher", [
        ("reverse KL to the teacher", "step", "nats per token", {"teacher KL": kl}, False),
        ("student", "step", "reward", {"train reward (not in the loss)": r["reward"]}, False)], r)
    del r["eval_after_sft"]
    return r


def judge(runs: Path) -> dict:
    """LLM-as-judge on the reverse task: a tiny judge taught the checklist's letter question
    and examined on every pair before it grades anything; a tiny policy after the default
    warm-up; GRPO on the judge's share of yeses alone. The exact held-out score, which the judge
    never sees, before and after. The judge learns to tell the task's letters apart suddenly,
    after a plateau (near step 1,050 in the measured run), so it is trained past that, then
    at a low lr, and must pass its exam."""
    from instar.tasks.judge_data import judge_data
    from instar.tasks.reverse_data import reverse_data

    train, held_out = reverse_data()
    judge_train, exam, demos = judge_data()
    # the built-in model's settings (a run with --model.path gets a pretrained model's)
    like_default = ["--rollout.max-tokens", "24", "--rollout.max-model-len", "1024"]
    exact = ["eval", "--agent", "instar/tasks/reverse.py", "--data.eval", held_out,
             "--eval.size", "256", *like_default]
    stages = {
        "judge-sft": (["sft", "--data.train", judge_train, "--eval.size", "0", "--train.steps",
                       "1500", "--train.lr", "2e-3", "--train.lr-schedule", "cosine",
                       "--train.min-lr-ratio", "0.02", "--data.prompts-per-step", "64"], "final"),
        "judge-polish": (["sft", "--model.path", str(runs / "judge-sft" / "final"), "--data.train",
                          judge_train, "--eval.size", "0", "--train.steps", "300", "--train.lr",
                          "2e-4", "--data.prompts-per-step", "64"], "final"),
        "judge-exam": (["eval", "--agent", "instar/tasks/reverse_judged.py:Exam", "--model.path",
                        str(runs / "judge-polish" / "final"), "--data.eval", exam, "--eval.size",
                        "1000", "--eval.temperature", "0.01", "--rollout.max-tokens", "4"],
                       "eval.json"),
        "policy-sft": (["sft", "--data.train", demos, "--train.steps", "60", "--train.lr", "3e-3",
                        "--data.prompts-per-step", "64", "--eval.size", "0"], "final"),
        "exact-before": ([*exact, "--model.path", str(runs / "policy-sft" / "final")],
                         "eval.json"),
        "judged-rl": (["rl", "--agent", "instar/tasks/reverse_judged.py", "--agent.judge",
                       str(runs / "judge-polish" / "final"), "--model.path",
                       str(runs / "policy-sft" / "final"), "--data.train", train, "--data.eval",
                       held_out, "--eval.size", "256", *like_default, "--train.warmup-sft-steps",
                       "0", "--train.lr", "1e-3"], "summary.json"),
        "exact-after": ([*exact, "--model.path", str(runs / "judged-rl" / "final")], "eval.json")}
    first = dict(list(stages.items())[:3])
    wall = run_stages(runs, first)
    passed = read(runs, "judge-exam", "eval.json")["eval/reward"]
    if passed < 1:  # a judge that misses a pair is one the policy learns to exploit
        sys.exit(f"the judge got {passed:.1%} of its exam right, not all: see "
                 f"{runs / 'judge-exam' / 'eval_samples.jsonl'}; train it longer")
    wall |= run_stages(runs, stages)
    summary, steps = read(runs, "judged-rl", "summary.json"), metrics(runs, "judged-rl")
    r = {"eval_before": read(runs, "exact-before", "eval.json")["eval/reward"],
         "eval_after": read(runs, "exact-after", "eval.json")["eval/reward"],
         "judged_eval_before": summary["eval_reward_before"],
         "judged_eval_after": summary["eval_reward_after"], "judge_exam": passed,
         "wall_s": round(sum(wall.values())), "stage_wall_s": {k: round(v) for k, v in wall.items()},
         "command": command("judge", runs, stages), "stage_load": loads(runs, stages),
         "judge_sft_loss": series(metrics(runs, "judge-sft"), "train/loss"),
         "judge_reward": series(steps, "rollout/reward"),
         "exact_reward": series(steps, "rollout/info/exact")}
    r["judge_minus_exact_max"] = max(abs(j - e) for j, e in zip(r["judge_reward"], r["exact_reward"]))
    plot("judge", "LLM-as-judge (reverse task): tiny judge, tiny policy, GRPO on the verdicts", [
        ("the judge learns its question", "SFT step", "verdict-token loss",
         {"loss": r["judge_sft_loss"]}, True),
        ("GRPO on the judge's reward", "RL step", "reward",
         {"judge's reward": r["judge_reward"], "exact score (the judge never sees it;\n"
          "it hides the judge's curve, the same)": r["exact_reward"]}, False)], r)
    return r


def plot(name: str, title: str, panels: list[tuple], r: dict) -> None:
    """`panels`: (title, x label, y label, {label: values per step}, log y); the last panel
    also shows the held-out evals of `r` at its start and end."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6))
    for ax, (head, x, y, lines, log) in zip(axes, panels):
        for label, ys in lines.items():
            ax.plot(range(1, len(ys) + 1), ys, label=label)
        ax.set(xlabel=x, ylabel=y, title=head, yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
    n = len(next(iter(panels[-1][3].values())))
    start = r.get("eval_after_sft", r["eval_before"])
    label = f"held-out: {r['eval_before']:.2f} at the start" + (
        f", {start:.2f} after SFT" if start != r["eval_before"] else "")
    axes[-1].plot([0, n], [start, r["eval_after"]], "o--", label=f"{label}, {r['eval_after']:.2f} after")
    axes[-1].set_ylim(0, 1.05)
    for ax in axes:
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    (ROOT / "docs" / "images").mkdir(exist_ok=True)
    fig.savefig(ROOT / "docs" / "images" / f"scenario_{name}.png", dpi=100)


SCENARIOS = {"tool_use": tool_use, "code_exec": code_exec, "vision": vision, "judge": judge,
             "distill": distill}


def main(runs: Path, names: list[str]) -> None:
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        sys.exit(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    old = json.loads(RESULTS.read_text())["scenarios"] if RESULTS.exists() else {}
    out = {n: old.get(n) for n in SCENARIOS}
    for n in names or SCENARIOS:  # the file is written as each ends: a stopped scenario
        out[n] = SCENARIOS[n](runs / n)  # (sys.exit) keeps the others' results
        RESULTS.write_text(json.dumps({
            "setup": {"machine": "2 cores, CPU only", "date": time.strftime("%Y-%m-%d")},
            "scenarios": out}, indent=1) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0] if args else "/tmp/scenarios").absolute(), args[1:])
