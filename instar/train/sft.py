"""Supervised fine-tuning: the one implementation behind `instar sft`, the warm-up before RL
(`--train.warmup-sft-steps`) and the tests' teaching helper.

A row is a chat conversation, {"messages": [...], "tools": [...]}; its sequence is the
conversation rendered by the model's chat template, with the loss on the assistant tokens
only (instar/train/sft_data.py). Each step draws `batch` rows at random (seeded) and takes
one optimizer step on their mean token loss. The warm-up turns each training task into a row:
its prompt, then its label as the assistant's answer.
"""

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers import AutoConfig, AutoImageProcessor

from instar.agents.chat import as_messages
from instar.agents.contract import Task
from instar.agents.images import IMAGE_TOKEN, decode, image_urls
from instar.config import Config
from instar.progress import Bar
from instar.tasks.tiny_model import cache_root
from instar.train.batch import Sequence
from instar.train.sft_data import assistant_mask
from instar.train.trainer import Trainer


def image_processor(base: Path):
    """A vision-language model's image processor; None for a text-only model."""
    if not hasattr(AutoConfig.from_pretrained(base), "vision_config"):
        return None
    return AutoImageProcessor.from_pretrained(base)


def check_images(rows: list[dict], base: Path, source: str):
    """The model's image processor (None: text only), once every row's images are read and
    the model can see them; otherwise a ValueError naming `source` and the row."""
    images = image_processor(base)
    for n, row in enumerate(rows, 1):  # (image_urls decodes each image: a bad one fails here)
        try:
            if image_urls(row["messages"]) and images is None:
                raise ValueError(f"it has images, but {base} is not a vision-language model")
        except ValueError as e:
            raise ValueError(f"{source}: row {n}: {e}") from None
    return images


def sequence(tokenizer, row: dict, images=None) -> Sequence:
    """A conversation as a training sequence. Its image parts (data URLs) need `images`, the
    model's image processor: each placeholder becomes as many tokens as the model reads the
    image as, as the engine expands it, and the images ride along for the trainer."""
    ids, mask = assistant_mask(tokenizer, row["messages"], row.get("tools"))
    if not (urls := image_urls(row["messages"])):
        return Sequence(ids, mask, [0.0] * len(ids))
    if images is None:
        raise ValueError("a conversation has images, but the model is not a vision-language one")
    grids = images(images=[decode(u) for u in urls], return_tensors="pt")["image_grid_thw"]
    sizes = iter(int(g.prod()) // images.merge_size ** 2 for g in grids)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    out = [(t, m) for t, m in zip(ids, mask) for _ in range(next(sizes) if t == pad else 1)]
    return Sequence([t for t, _ in out], [m for _, m in out], [0.0] * len(out), images=urls)


def supervised(trainer, tokenizer, rows: list[dict], steps: int, batch: int,
               lr: Callable[[int], float], seed: int, images=None) -> Iterator[tuple[int, dict]]:
    """`steps` optimizer steps of `trainer` (anything with `step(seqs, "sft", lr)`), each on
    `batch` rows drawn at random; yields (step, the step's stats). `images`: see `sequence`."""
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        picked = rng.sample(rows, min(batch, len(rows)))
        yield step, trainer.step([sequence(tokenizer, r, images) for r in picked], "sft", lr(step))


def label_rows(tasks: list[Task]) -> list[dict]:
    """Each task as a conversation: its prompt, then its label as the assistant's answer."""
    if any(task.label is None for task in tasks):
        raise ValueError("--train.warmup-sft-steps needs a `label` on every training task; "
                         "set it to 0 for data without labels")
    return [{"messages": as_messages(t.prompt) + [{"role": "assistant", "content": str(t.label)}]}
            for t in tasks]


def warmup(cfg: Config, base: Path, rows: list[dict], tokenizer) -> Path:
    """Supervised warm-up on `rows` (chat rows: demonstrations, or `label_rows` of the
    training tasks); the result is cached as an HF folder keyed by the base model, the rows
    and the warm-up's settings."""
    t = cfg.train
    key = hashlib.sha256(json.dumps(["sft-v3", str(base), rows, t.warmup_sft_steps,
                                     t.warmup_sft_lr, t.warmup_sft_batch, t.num_ranks,
                                     cfg.model.dtype, t.master_dtype, cfg.data.seed]).encode())
    out = cache_root() / "warm" / key.hexdigest()[:16]
    if (out / "model.safetensors").exists():
        print(f"supervised warm-up: cached in {out}", flush=True)
        return out
    trainer = Trainer(cfg, str(base))
    try:
        with Bar("supervised warm-up step", t.warmup_sft_steps, live=cfg.logging.progress,
                 every=cfg.logging.print_every) as bar:
            for _, stats in supervised(trainer, tokenizer, rows, t.warmup_sft_steps,
                                       t.warmup_sft_batch, lambda _: t.warmup_sft_lr,
                                       cfg.data.seed, image_processor(base)):
                bar.advance(1, f"loss {stats['loss']:.4f}")
        trainer.export(base, out)
    finally:
        trainer.shutdown()
    return out
