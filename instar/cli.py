"""instar's command line: rl (train), sft (supervised), eval (a checkpoint on held-out
tasks), rollout (no training), serve (engine + gateway), make-model (build a tiny model)."""

import argparse
import dataclasses
import signal
import sys
from dataclasses import dataclass
from typing import Literal

import tyro
import yaml

from instar.config import Config, load_yaml
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


SECTIONS = {
    "rl": ("model", "data", "agent", "rollout", "eval", "train", "algo", "checkpoint", "logging",
           "cluster"),
    "sft": ("model", "data", "eval", "train", "checkpoint", "logging", "cluster"),
    "eval": ("model", "data", "agent", "rollout", "eval", "logging", "cluster"),
    "rollout": ("model", "data", "agent", "rollout", "logging", "cluster"),
    "serve": ("model", "rollout", "logging", "cluster", "serve"),
}
"""The config sections each command reads: its flags, its --help and its --print-config. The
other sections keep their defaults (or the recipe's values), so every setting has one flag
name and one default in all commands."""


def parse(command: str, argv: list[str], description: str) -> tuple[Config, bool]:
    """The run config from a recipe and flags; exits with a clear message if it is invalid."""
    sections = SECTIONS[command]
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    if "agent" in sections:
        pre.add_argument("--agent", default=None)
    known, rest = pre.parse_known_args(argv)
    cfg = load_yaml(known.config) if known.config else Config()
    if getattr(known, "agent", None):
        cfg.agent.file = known.agent
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    flags = dataclasses.make_dataclass(f"{command}_flags", [(s, types[s]) for s in sections])
    parsed = tyro.cli(flags, args=rest, default=flags(*(getattr(cfg, s) for s in sections)),
                      prog=f"instar {command}",
                      description=description + " Extra flags: --config recipe.yaml (defaults "
                      "from a YAML recipe), --print-config (print and exit).")
    cfg = dataclasses.replace(cfg, **{s: getattr(parsed, s) for s in sections})
    try:
        cfg.validate(rl=command == "rl")
    except ValueError as e:
        sys.exit(f"instar {command}: config error: {e}")
    if known.print_config:
        print(yaml.safe_dump({s: dataclasses.asdict(getattr(cfg, s)) for s in sections},
                             sort_keys=False), end="")
    return cfg, known.print_config


def rl(argv: list[str]) -> None:
    cfg, printed = parse("rl", argv, "Train an agent with RL.")
    if printed:
        return
    from instar.loop import run

    summary = run(cfg)
    print_summary(summary)


def sft(argv: list[str]) -> None:
    cfg, printed = parse("sft", argv, "Supervised fine-tuning on chat JSONL (--data.train; rows "
                         "{messages, tools}), loss on assistant tokens.")
    if printed:
        return
    from instar.sft import run_sft

    s = run_sft(cfg)
    if s["eval_loss_before"] is not None:
        print(f"instar sft: held-out assistant-token loss {s['eval_loss_before']:.4f} -> "
              f"{s['eval_loss_after']:.4f}")


def eval_(argv: list[str]) -> None:
    cfg, printed = parse("eval", argv, "Evaluate a checkpoint (--model.path) on held-out tasks "
                         "(--data.eval) with the run's eval settings (--eval.*), no training.")
    if printed:
        return
    from instar.jobs import evaluate_model

    evaluate_model(cfg)


def rollout(argv: list[str]) -> None:
    cfg, printed = parse("rollout", argv, "Run an agent over tasks (--data.train), "
                         "--rollout.group-size episodes each, no training; write the samples "
                         "to the run directory (--logging.root/--logging.name).")
    if printed:
        return
    from instar.jobs import rollout

    rollout(cfg)


def serve(argv: list[str]) -> None:
    cfg, printed = parse("serve", argv, "Serve the engines behind the gateway; print the base "
                         "URLs and the key; on Ctrl-C write the sessions to the run directory.")
    if printed:
        return
    from instar.jobs import serve

    serve(cfg)


def print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="instar rl: summary")
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


def make_model(argv: list[str]) -> None:
    from instar.tasks.tiny_model import build_model

    args = tyro.cli(MakeModel, args=argv, prog="instar make-model")
    print(build_model(args.out, args.kind, args.size, args.seed))


COMMANDS = {"rl": rl, "sft": sft, "eval": eval_, "rollout": rollout, "serve": serve,
            "make-model": make_model}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: instar {{{','.join(COMMANDS)}}} [--help]")
    try:
        with command():  # no process of the command outlives it (instar/processes.py)
            COMMANDS[argv[0]](argv[1:])
    except Preempted as e:
        print(f"instar {argv[0]}: {e}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
