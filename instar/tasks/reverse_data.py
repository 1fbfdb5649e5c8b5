"""Data for the built-in reverse task, generated deterministically and cached as JSONL."""

import random

from instar.tasks.tiny_model import cache_root, write_rows

LETTERS = "abcdefgh"


def _rows(seed: int, n: int, exclude: set[str]) -> list[dict]:
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        if s not in exclude:
            exclude.add(s)
            rows.append({"id": s, "prompt": f"Reverse: {s}", "label": s[::-1]})
    return rows


def reverse_data() -> tuple[str, str]:
    """Paths of (train, eval) JSONL; the eval strings never occur in train."""
    folder = cache_root() / "data" / "reverse-v1"
    train, held_out = folder / "train.jsonl", folder / "eval.jsonl"
    if not held_out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        seen: set[str] = set()
        eval_rows = _rows(1, 256, seen)
        for path, rows in ((train, _rows(0, 20000, seen)), (held_out, eval_rows)):
            write_rows(path, rows)
    return str(train), str(held_out)
