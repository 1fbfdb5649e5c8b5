"""instar's command line: rl (train), sft (supervised), eval (a checkpoint on held-out
tasks), rollout (no training), serve (engine + gateway), make-model (build a tiny model)."""

import argparse
import sys
from dataclasses import dataclass
from typing import Literal

import tyro

from instar.config import Config, load_yaml


@dataclass
class MakeModel:
    """Build a built-in checkpoint (Qwen3 dense or MoE, or a Qwen2-VL vision-language model)
    from a seed."""

    out: str
    """Folder to write the Hugging Face checkpoint to."""
    kind: Literal["dense", "moe", "vl"] = "dense"
    size: Literal["tiny", "small"] = "tiny"
    seed: int = 0


def parse(argv: list[str], prog: str, description: str) -> tuple[Config, bool]:
    """The run config from a recipe and flags; exits with a clear message if it is invalid."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    pre.add_argument("--agent", default=None)
    known, rest = pre.parse_known_args(argv)
    default = load_yaml(known.config) if known.config else Config()
    if known.agent:
        default.agent.file = known.agent
    cfg = tyro.cli(Config, args=rest, default=default, prog=prog,
                   description=description + " Extra flags: --config recipe.yaml (defaults "
                               "from a YAML recipe), --print-config (print and exit).")
    try:
        cfg.validate()
    except ValueError as e:
        sys.exit(f"{prog}: config error: {e}")
    if known.print_config:
        print(cfg.to_yaml(), end="")
    return cfg, known.print_config


def rl(argv: list[str]) -> None:
    cfg, printed = parse(argv, "instar rl", "Train an agent with RL.")
    if printed:
        return
    from instar.loop import run

    summary = run(cfg)
    print_summary(summary)


def sft(argv: list[str]) -> None:
    cfg, printed = parse(argv, "instar sft", "Supervised fine-tuning on chat JSONL "
                         "(--data.train; rows {messages, tools}), loss on assistant tokens.")
    if printed:
        return
    from instar.sft import run_sft

    s = run_sft(cfg)
    if s["eval_loss_before"] is not None:
        print(f"instar sft: held-out assistant-token loss {s['eval_loss_before']:.4f} -> "
              f"{s['eval_loss_after']:.4f}")


def eval_(argv: list[str]) -> None:
    cfg, printed = parse(argv, "instar eval", "Evaluate a checkpoint (--model.path) on held-out "
                         "tasks (--data.eval) with the run's eval settings (--eval.*), no training.")
    if printed:
        return
    from instar.jobs import evaluate_model

    evaluate_model(cfg)


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


def rollout(argv: list[str]) -> None:
    from instar.jobs import RolloutArgs, rollout

    rollout(tyro.cli(RolloutArgs, args=argv, prog="instar rollout"))


def serve(argv: list[str]) -> None:
    from instar.jobs import ServeArgs, serve

    serve(tyro.cli(ServeArgs, args=argv, prog="instar serve"))


COMMANDS = {"rl": rl, "sft": sft, "eval": eval_, "rollout": rollout, "serve": serve, "make-model": make_model}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: instar {{{','.join(COMMANDS)}}} [--help]")
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
