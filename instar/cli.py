"""instar's command line: rl (train), rollout (no training), serve (engine + gateway),
make-model (build a tiny model)."""

import argparse
import sys
from dataclasses import dataclass
from typing import Literal

import tyro

from instar.config import Config, load_yaml


@dataclass
class MakeModel:
    """Build a built-in Qwen3-shaped checkpoint (dense or MoE) from a seed."""

    out: str
    """Folder to write the Hugging Face checkpoint to."""
    kind: Literal["dense", "moe"] = "dense"
    size: Literal["tiny", "small"] = "tiny"
    seed: int = 0


def rl(argv: list[str]) -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    pre.add_argument("--agent", default=None)
    known, rest = pre.parse_known_args(argv)
    default = load_yaml(known.config) if known.config else Config()
    if known.agent:
        default.agent.file = known.agent
    cfg = tyro.cli(Config, args=rest, default=default, prog="instar rl",
                   description="Train an agent with RL. Extra flags: --config recipe.yaml "
                               "(defaults from a YAML recipe), --print-config (print and exit).")
    try:
        cfg.validate()
    except ValueError as e:
        sys.exit(f"instar rl: config error: {e}")
    if known.print_config:
        print(cfg.to_yaml(), end="")
        return
    from instar.loop import run

    summary = run(cfg)
    print_summary(summary)


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
    table.add_row("eval reward (held-out, before / after)", f"{s['eval_reward_before']:.3f}",
                  f"{s['eval_reward_after']:.3f}")
    Console().print(table)
    if s["failed_rollouts"]:
        Console().print(f"failed rollouts: {s['failed_rollouts']}")


def make_model(argv: list[str]) -> None:
    from instar.tasks.tiny_model import build_model

    args = tyro.cli(MakeModel, args=argv, prog="instar make-model")
    print(build_model(args.out, args.kind, args.size, args.seed))


def rollout(argv: list[str]) -> None:
    from instar.jobs import RolloutArgs, rollout

    rollout(tyro.cli(RolloutArgs, args=argv, prog="instar rollout"))


def serve(argv: list[str]) -> None:
    from instar.jobs import ServeArgs, serve

    serve(tyro.cli(ServeArgs, args=argv, prog="instar serve"))


COMMANDS = {"rl": rl, "rollout": rollout, "serve": serve, "make-model": make_model}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: instar {{{','.join(COMMANDS)}}} [--help]")
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
