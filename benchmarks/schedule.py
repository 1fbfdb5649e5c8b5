"""instar's step time under each --rollout.schedule (auto, overlap, sequential), side by side
in one invocation, on the default job and on bench.py's grpo-small and long workloads.

    .venv/bin/python benchmarks/schedule.py                 # about 25 minutes on 2 cores
    .venv/bin/python benchmarks/schedule.py --only default

Writes benchmarks/results/schedule.json: for each workload, what auto chose (read from the
run's config.yaml) and, per schedule, the median, min and max wall seconds per step over
the measured steps and the run's wall time. `auto_over_best`: auto's median step over the
better of overlap and sequential (at most 1 plus noise is what auto promises). Each workload
runs auto, overlap, then sequential, one run at a time with the machine to itself.

  default     `instar rl` as `make run` runs it (built-in tiny model, warm-up cached, evals
              included in the run's wall time); steps 2-150 measured
  grpo-small  one run of bench.py's workload (built-in small model, 16 x 8 samples, up to
              128 tokens): 1 warm-up step, 5 measured
  long        bench.py's (4 x 4 samples of 1024 tokens each): 1 warm-up step, 3 measured
  agentic-tail  bench.py's (1-8 turns, log-normal tool latencies): 1 warm-up step, 5
              measured; only when named in --only
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import instar_side, weights_for, write_tasks
from bench_tasks import WORKLOADS

from instar.cli import main as instar
from instar.tasks.tiny_model import builtin_model

HERE = Path(__file__).parent
SCHEDULES = ["auto", "overlap", "sequential"]
BENCH = {name: WORKLOADS[name] for name in ("grpo-small", "long", "agentic-tail")}
DEFAULT = ["default", "grpo-small", "long"]  # (agentic-tail when named)


def chosen(run_dir: Path) -> str:
    """The schedule the run took (its config.yaml has auto resolved)."""
    for line in (run_dir / "config.yaml").read_text().splitlines():
        if line.strip().startswith("schedule:"):
            return line.split(":", 1)[1].strip()
    raise RuntimeError(f"no schedule in {run_dir / 'config.yaml'}")


def default_job(schedule: str, root: Path) -> tuple[list[float], str]:
    instar(["rl", "--data.task", "reverse", "--rollout.schedule", schedule, "--logging.root",
            str(root), "--logging.name", schedule, "--logging.no-progress"])
    times = [json.loads(x)["time"] for x in (root / schedule / "metrics.jsonl").read_text()
             .splitlines() if '"rollout/reward"' in x]
    return [b - a for a, b in zip(times, times[1:])], chosen(root / schedule)


def bench_workload(name: str, schedule: str, root: Path) -> tuple[list[float], str]:
    w = BENCH[name]
    model = weights_for(w, builtin_model("dense", "small", 0))
    folder = root / schedule
    folder.mkdir(parents=True)
    tasks, _ = write_tasks(w, folder)
    steps, _ = instar_side(w, model, tasks, folder, {"rollout": {"schedule": schedule}})
    return [s["step_s"] for s in steps], chosen(folder / "instar")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=["default", *BENCH])
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=SCHEDULES)
    p.add_argument("--out", default=str(HERE / "results" / "schedule.json"))
    args = p.parse_args()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "command": " ".join([".venv/bin/python benchmarks/schedule.py", *sys.argv[1:]]),
              "workloads": {}}
    for name in args.only or DEFAULT:
        root, runs = Path(tempfile.mkdtemp(prefix=f"schedule-{name}-")), {}
        for schedule in args.schedules:
            t0 = time.perf_counter()
            steps, took = default_job(schedule, root) if name == "default" else \
                bench_workload(name, schedule, root)
            runs[schedule] = {"took": took, "wall_s": round(time.perf_counter() - t0, 1),
                              "step_s": {"median": statistics.median(steps), "min": min(steps),
                                         "max": max(steps), "n": len(steps)}}
            print(f"[{name}] {schedule} ({took}): median step {statistics.median(steps):.2f} s",
                  flush=True)
        median = {s: runs[s]["step_s"]["median"] for s in runs}
        result["workloads"][name] = {"runs": runs}
        if len(runs) == 3:
            result["workloads"][name].update(auto_chose=runs["auto"]["took"], auto_over_best=
                                             median["auto"] / min(median["overlap"], median["sequential"]))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
