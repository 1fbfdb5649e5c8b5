"""instar sft: supervised fine-tuning on chat JSONL, the loss on assistant tokens only.

    instar sft                                   # the built-in data on the built-in model
    instar sft --data.train chats.jsonl --model.path DIR

Rows are {"messages": [...], "tools": [...]}; masks come from the chat template (see
instar/train/sft_data.py). Each step takes `--data.prompts-per-step` rows; the same FSDP2
ranks, learning-rate schedule and export as `instar rl` (the steps: instar/train/sft.py).
With `--data.eval` (or the built-in data's held-out part) the mean assistant-token loss is
measured before and after.
"""

import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from instar.cluster import ray_for
from instar.config import Config
from instar.inputs import model_path
from instar.progress import Bar
from instar.train.batch import Sequence
from instar.train.schedule import lr_at
from instar.train.sft import check_images, image_processor, sequence, supervised
from instar.train.sft_data import builtin_sft_data, load_sft_jsonl
from instar.train.trainer import Trainer


def eval_loss(trainer: Trainer, seqs: list[Sequence]) -> float:
    """Mean negative log-likelihood of the assistant tokens."""
    scores = trainer.score(seqs, temperature=1.0)
    nll = [-lp for s, lps in zip(seqs, scores) for lp, m in zip(lps, s.mask) if m]
    return sum(nll) / len(nll)


def sft_inputs(cfg: Config) -> tuple[Path, object, list[dict], list[Sequence]]:
    """The model folder, its tokenizer, the training rows and the held-out sequences."""
    base = model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = load_sft_jsonl(cfg.data.train or builtin_sft_data())
    held_out = load_sft_jsonl(cfg.data.eval) if cfg.data.eval else []
    if not cfg.data.train:  # built-in data: hold some rows out
        rows, held_out = rows[cfg.eval.size:], rows[:cfg.eval.size]
    images = check_images(rows, base, cfg.data.train or "the built-in data")
    return base, tokenizer, rows, [sequence(tokenizer, row, images)
                                   for row in held_out[:cfg.eval.size]]


def run_sft(cfg: Config, inputs: tuple | None = None) -> dict:
    """`inputs`: `sft_inputs(cfg)`, already checked (default: read them now)."""
    cfg.validate(rl=False, trains=True)
    base, tokenizer, rows, held_out = inputs or sft_inputs(cfg)
    run_dir = Path(cfg.logging.root).absolute() / (cfg.logging.name or time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    with ray_for(cfg.cluster.ray_address):
        return train(cfg, run_dir, base, tokenizer, rows, held_out)


def train(cfg: Config, run_dir: Path, base: Path, tokenizer, rows: list[dict],
          held_out: list[Sequence]) -> dict:
    trainer = Trainer(cfg, str(base))
    try:
        summary = {"eval_loss_before": eval_loss(trainer, held_out) if held_out else None}
        bar = Bar("sft step", cfg.train.steps, live=cfg.logging.progress,
                  every=cfg.logging.print_every)
        with open(run_dir / "metrics.jsonl", "w") as metrics, bar:
            t0 = time.time()
            for step, stats in supervised(trainer, tokenizer, rows, cfg.train.steps,
                                          cfg.data.prompts_per_step,
                                          lambda k: lr_at(k, cfg.train), cfg.data.seed,
                                          image_processor(base)):
                m = {"step": step, "train/loss": stats["loss"],
                     "train/grad_norm": stats["grad_norm"], "train/lr": lr_at(step, cfg.train),
                     "timing/step_s": time.time() - t0}
                t0 = time.time()
                metrics.write(json.dumps(m) + "\n")
                metrics.flush()
                bar.advance(1, f"loss {m['train/loss']:.4f}")
        summary["eval_loss_after"] = eval_loss(trainer, held_out) if held_out else None
        if cfg.checkpoint.save_final:
            trainer.export(base, run_dir / "final")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    finally:
        trainer.shutdown()
    return {**summary, "run_dir": str(run_dir)}
