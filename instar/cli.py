"""instar's command line: rl (train), sft (supervised), eval (a checkpoint on held-out
tasks), rollout (no training), serve (engine + gateway), make-model (build a tiny model),
check-model (a checkpoint's chat template and tokenizer, checked for instar), view (a run's
episodes as one HTML page), replay (a step recomputed from its replay bundle)."""

import argparse
import dataclasses
import importlib.metadata
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro
import yaml

from instar.config import Config, load_yaml
from instar.errors import LayoutError
from instar.processes import Preempted, command


@dataclass
class MakeModel:
    """Build a built-in checkpoint (Qwen3 dense or MoE, or a Qwen2-VL vision-language model)
    from a seed."""

    out: str
    """Folder to write the Hugging Face checkpoint to."""
    kind: Literal["dense", "moe", "vl"] = "dense"
    size: Literal["tiny", "small"] = "tiny"
    seed: int = 0


@dataclass
class View:
    """Write one self-contained HTML page of runs' episodes (instar/view.py)."""

    paths: tyro.conf.Positional[list[str]]
    """Run directories (of instar rl, rollout, eval, serve) or samples files (rollouts.jsonl)."""
    out: str = ""
    """Where to write the page. Empty: view.html in the first run directory (for a samples
    file: its name with .html)."""
    tokenizer: str = ""
    """The tokenizer that decodes the tokens (a folder or Hub id). Empty: the run's model's."""


@dataclass
class Replay:
    """Recompute a step of instar rl from its replay bundle, on this machine's CPU, and compare
    it with the run (instar/replay.py)."""

    bundle: tyro.conf.Positional[str]
    """The bundle: a folder runs/RUN/bundles/step-N (written with --logging.bundle-every)."""
    ranks: int = 0
    """Training ranks (processes) to replay on. 0: as many as the run had."""
    tolerance: float = 0.0
    """The largest |difference| accepted in the loss, the grad norm and any updated weight. 0:
    bitwise, what the run's rank count gives; another rank count sums in another order."""


SECTIONS = {
    "rl": ("model", "data", "agent", "rollout", "eval", "lora", "train", "algo", "health",
           "checkpoint", "logging", "cluster"),
    "sft": ("model", "data", "eval", "lora", "train", "checkpoint", "logging", "cluster"),
    "eval": ("model", "data", "agent", "rollout", "eval", "lora", "logging", "cluster"),
    "rollout": ("model", "data", "agent", "rollout", "lora", "logging", "cluster"),
    "serve": ("model", "rollout", "lora", "logging", "cluster", "serve"),
}
"""The config sections each command reads: its flags, its --help and its --print-config. The
other sections keep their defaults (or the recipe's values), so every setting has one flag
name and one default in all commands."""


HELP = {
    "rl": "Train an agent with RL.",
    "sft": "Supervised fine-tuning on chat data. Rows {messages, tools} from --data.train; loss "
           "on assistant tokens.",
    "eval": "Evaluate a checkpoint on held-out tasks, without training. --model.path on "
            "--data.eval, with the run's eval settings (--eval.*).",
    "rollout": "Run an agent over tasks, without training. --rollout.group-size episodes of each "
               "task of --data.train; the samples go to the run directory.",
    "serve": "Serve the engines behind the gateway. Prints the base URLs and the key; on Ctrl-C "
             "writes the sessions to the run directory.",
    "make-model": "Build a built-in tiny checkpoint from a seed. Qwen3 dense or MoE, or Qwen2-VL.",
    "view": "Write runs' episodes as one HTML page. Each conversation token by token (coloured by "
            "log-prob, version lag or engine-vs-trainer difference), failures with their "
            "tracebacks, filters; one self-contained file, no server.",
    "replay": "Recompute a step of instar rl from its replay bundle. On a CPU, with no Ray or "
              "engines: its loss, grad norm and updated weights against the run's; exit 1 if "
              "they differ beyond --tolerance.",
    "check-model": "Check a checkpoint's chat template and tokenizer for instar. Prefix "
                   "stability, tool-call round trip, control tokens, reasoning in history, and "
                   "the features safe with the model; exit 1 on a blocking problem.",
}
"""What each command does: its --help, and a line of `instar --help`."""


DEBUG = False
"""`instar --debug ...`: errors in the inputs show their traceback."""


@contextmanager
def checks(command: str, kinds: tuple = (ValueError, TypeError, OSError, LayoutError)
           ) -> Iterator[None]:
    """What the run is given (config, model, data, agent) is checked before anything starts;
    a bad input (an exception of `kinds`) is one line on stderr and exit code 2, with no
    traceback unless --debug."""
    try:
        yield
    except kinds as e:
        if DEBUG:
            raise
        print(f"instar {command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


def parse(command: str, argv: list[str]) -> tuple[Config, bool]:
    """The run config from a recipe and flags; exits with a clear message if it is invalid."""
    sections = SECTIONS[command]
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    if "agent" in sections:
        pre.add_argument("--agent", default=None)
    known, rest = pre.parse_known_args(argv)
    with checks(command):
        cfg = load_yaml(known.config) if known.config else Config()
    if getattr(known, "agent", None):
        cfg.agent.file = known.agent
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    flags = dataclasses.make_dataclass(f"{command}_flags", [(s, types[s]) for s in sections])
    parsed = tyro.cli(flags, args=rest, default=flags(*(getattr(cfg, s) for s in sections)),
                      prog=f"instar {command}",
                      description=HELP[command] + " Extra flags: --config recipe.yaml (defaults "
                      "from a YAML recipe), --print-config (print the resolved config and exit), "
                      "--debug (errors with their traceback).")
    cfg = dataclasses.replace(cfg, **{s: getattr(parsed, s) for s in sections})
    with checks(command):
        cfg.validate(rl=command == "rl", trains=command in ("rl", "sft"))
    if known.print_config:
        print(yaml.safe_dump({s: dataclasses.asdict(getattr(cfg, s)) for s in sections},
                             sort_keys=False), end="")
    return cfg, known.print_config


def rl(argv: list[str]) -> None:
    cfg, printed = parse("rl", argv)
    if printed:
        return
    from instar.health import HealthError
    from instar.inputs import run_inputs
    from instar.loop import run

    with checks("rl"):
        inputs = [run_inputs(c) for _, c in cfg.lanes()]
    with checks("rl", (LayoutError, HealthError)):  # (a cluster too small; a health stop)
        summary = run(cfg, inputs)
    print_summary(summary)


def sft(argv: list[str]) -> None:
    cfg, printed = parse("sft", argv)
    if printed:
        return
    from instar.sft import run_sft, sft_inputs

    with checks("sft"):
        inputs = sft_inputs(cfg)
    s = run_sft(cfg, inputs)
    if s["eval_loss_before"] is not None:
        print(f"instar sft: held-out assistant-token loss {s['eval_loss_before']:.4f} -> "
              f"{s['eval_loss_after']:.4f}")
    print(outputs(Path(s["run_dir"])))


def eval_(argv: list[str]) -> None:
    cfg, printed = parse("eval", argv)
    if printed:
        return
    from instar.inputs import run_inputs
    from instar.jobs import evaluate_model

    with checks("eval"):
        inputs = run_inputs(cfg)
        if not inputs.eval_tasks:
            raise ValueError("instar eval needs held-out tasks: --data.eval FILE and --eval.size > 0")
    with checks("eval", (LayoutError,)):
        result = evaluate_model(cfg, inputs)
    if result["failed"] and sum(result["failed"].values()) == result["tasks"] * cfg.eval.samples:
        sys.exit(f"instar eval: every episode failed: {result['failed']}")


def rollout(argv: list[str]) -> None:
    cfg, printed = parse("rollout", argv)
    if printed:
        return
    from instar.inputs import run_inputs
    from instar.jobs import rollout

    with checks("rollout"):
        inputs = run_inputs(cfg)
    with checks("rollout", (LayoutError,)):
        summary = rollout(cfg, inputs)
    if summary["failed"] and not summary["episodes"]:
        sys.exit(f"instar rollout: every episode failed: {summary['failed']}")


def serve(argv: list[str]) -> None:
    cfg, printed = parse("serve", argv)
    if printed:
        return
    from instar.inputs import model_path
    from instar.jobs import serve
    from instar.rollout.parsers import check as check_parsers

    with checks("serve"):
        path = model_path(cfg)
        check_parsers(cfg.model.tool_parser, cfg.model.reasoning_parser)
    with checks("serve", (LayoutError,)):
        serve(cfg, path)


def print_summary(s: dict, title: str = "instar rl: summary") -> None:
    from rich.console import Console
    from rich.table import Table

    if "adapters" in s:  # multi-LoRA: a table for each adapter
        for name, adapter in s["adapters"].items():
            print_summary({**adapter, "run_dir": ""}, f"instar rl: adapter {name}")
        print(outputs(Path(s["run_dir"])))
        return
    table = Table(title=title)
    table.add_column("")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right")
    if "reward_first_step" in s:
        table.add_row("train reward (first / last step)", f"{s['reward_first_step']:.3f}",
                      f"{s['reward_last_step']:.3f}")
        table.add_row("train reward (mean of first / last 20% of steps)",
                      f"{s['reward_first_steps_mean']:.3f}", f"{s['reward_last_steps_mean']:.3f}")
    if s.get("eval_reward_after") is not None:
        table.add_row("eval reward (held-out, before / after)",
                      f"{s['eval_reward_before']:.3f}" if s.get("eval_reward_before") is not None
                      else "-", f"{s['eval_reward_after']:.3f}")
    Console().print(table)
    if s["failed_rollouts"]:
        Console().print(f"failed rollouts: {s['failed_rollouts']}")
    if s["run_dir"]:
        print(outputs(Path(s["run_dir"])))


def outputs(run_dir: Path) -> str:
    """Where a finished run's results are, for those it wrote."""
    names = {"final": "model", "plots": "plots", "metrics.jsonl": "metrics",
             "rollouts.jsonl": "rollouts", "adapters": "adapters"}
    lines = [f"  {name:<12}{run_dir / f}" for f, name in names.items() if (run_dir / f).exists()]
    if (run_dir / "tensorboard").exists():
        lines.append(f"  {'tensorboard':<12}tensorboard --logdir {run_dir.parent}")
    return "\n".join([f"run directory {run_dir}", *lines])


def make_model(argv: list[str]) -> None:
    from instar.tasks.tiny_model import build_model

    args = tyro.cli(MakeModel, args=argv, prog="instar make-model", description=HELP["make-model"])
    print(build_model(args.out, args.kind, args.size, args.seed))


def check_model(argv: list[str]) -> None:
    from instar.check_model import CheckModel, load, run_checks, show

    args = tyro.cli(CheckModel, args=argv, prog="instar check-model",
                    description=HELP["check-model"])
    with checks("check-model"):
        folder, tokenizer = load(args.dir, args.model.tool_parser, args.model.reasoning_parser)
    findings = run_checks(folder, tokenizer, args.model.tool_parser, args.model.reasoning_parser)
    show(args.dir, findings)
    if any(f.level == "block" for f in findings):
        sys.exit(1)


def view(argv: list[str]) -> None:
    from instar.view import write

    args = tyro.cli(View, args=argv, prog="instar view", description=HELP["view"])
    with checks("view"):
        print(write(args.paths, args.out, args.tokenizer))


def replay(argv: list[str]) -> None:
    from instar.bundle import read

    args = tyro.cli(Replay, args=argv, prog="instar replay", description=HELP["replay"])
    with checks("replay"):
        if args.ranks < 0 or args.tolerance < 0:
            raise ValueError("--ranks and --tolerance must be >= 0")
        bundle = read(args.bundle)
    from instar.replay import compare, rerun

    world = args.ranks or bundle.meta["ranks"]
    ranks = {n: f"{n} rank{'s' * (n > 1)}" for n in (world, bundle.meta["ranks"])}
    print(f"instar replay: step {bundle.meta['step']} of {bundle.folder.parent.parent} "
          f"(trained on {ranks[bundle.meta['ranks']]}, replayed on {ranks[world]})", flush=True)
    lines, ok = compare(bundle, rerun(bundle, world), args.tolerance)
    print("\n".join(lines))
    if not ok:
        sys.exit(f"instar replay: the replay differs from the run beyond --tolerance "
                 f"{args.tolerance:g}")


COMMANDS = {"rl": rl, "sft": sft, "eval": eval_, "rollout": rollout, "serve": serve,
            "make-model": make_model, "check-model": check_model, "view": view, "replay": replay}


def usage() -> str:
    lines = [f"  {name:<11} {HELP[name].split('. ')[0].rstrip('.')}" for name in COMMANDS]
    return ("usage: instar COMMAND [--help] [flags]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`instar COMMAND --help` lists a command's flags.")


def main(argv: list[str] | None = None) -> None:
    global DEBUG
    argv = sys.argv[1:] if argv is None else argv
    DEBUG = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv[:1] in (["--help"], ["-h"]):
        print(usage())
        return
    if argv[:1] == ["--version"]:
        print(f"instar {importlib.metadata.version('instar')}")
        return
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        sys.exit(2)
    try:
        with command():  # no process of the command outlives it (instar/processes.py)
            COMMANDS[argv[0]](argv[1:])
    except Preempted as e:
        print(f"instar {argv[0]}: {e}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
