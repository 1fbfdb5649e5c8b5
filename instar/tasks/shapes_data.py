"""Data for the shapes task (instar/tasks/shapes.py): coloured shapes drawn locally.

    python -m instar.tasks.shapes_data     # prints the paths: train, eval, demos

A row: `prompt` ("What colour is the shape?"), `label` (the first shape's colour), `shapes`
(two [shape, colour, x, y, radius] entries: the first image, and the one the second turn
shows), `id`. The images are drawn from these numbers (`draw`), so the JSONL stays small and
every run sees the same pixels. Held out: three (shape, colour) pairs never drawn in train.
Demos: the train rows as the conversations a right answer makes (both images, as PNG data
URLs, in the turns where the Env shows them), for `instar sft` on a vision-language model.
"""

import random

from instar.agents.images import data_url
from instar.tasks.tiny_model import cache_root, write_rows

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
           "yellow": (230, 200, 30)}
SHAPES = ["circle", "square", "triangle"]
HELD_OUT = {("triangle", "blue"), ("circle", "yellow"), ("square", "green")}
SIZE = 56
"""Images are SIZE x SIZE pixels: 4 image tokens each on the built-in vision model."""


def draw(shape: str, colour: str, x: int, y: int, r: int):
    """A white SIZE x SIZE PIL image with one filled shape of radius `r` centred at (x, y)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        pen.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    elif shape == "square":
        pen.rectangle([x - r, y - r, x + r, y + r], fill=fill)
    else:
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return image


def _shape(rng: random.Random, held_out: bool) -> list:
    while True:
        pair = (rng.choice(SHAPES), rng.choice(list(COLOURS)))
        if (pair in HELD_OUT) == held_out:
            r = rng.randint(8, 16)
            return [*pair, rng.randint(r, SIZE - r), rng.randint(r, SIZE - r), r]


def _rows(seed: int, n: int, held_out: bool) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        shapes = [_shape(rng, held_out), _shape(rng, held_out)]
        rows.append({"id": f"{'eval' if held_out else 'train'}-{i}",
                     "prompt": "What colour is the shape?", "label": shapes[0][1],
                     "shapes": shapes})
    return rows


def demo(row: dict) -> dict:
    """The conversation of `row` answered right, as the Env (instar/tasks/shapes.py) shows it."""
    messages = []
    for (shape, colour, *where), text in zip(row["shapes"], [row["prompt"], "And this one?"]):
        image = {"type": "image", "image": data_url(draw(shape, colour, *where))}
        messages += [{"role": "user", "content": [image, {"type": "text", "text": text}]},
                     {"role": "assistant", "content": colour}]
    return {"messages": messages}


def shapes_data() -> tuple[str, str, str]:
    """Paths of (train, eval, demos) JSONL, built into the cache once."""
    folder = cache_root() / "data" / "shapes-v1"
    paths = folder / "train.jsonl", folder / "eval.jsonl", folder / "demos.jsonl"
    if not paths[2].exists():
        folder.mkdir(parents=True, exist_ok=True)
        train = _rows(0, 2000, False)
        for path, rows in zip(paths, (train, _rows(1, 32, True), [demo(r) for r in train])):
            write_rows(path, rows)
    return tuple(str(p) for p in paths)


if __name__ == "__main__":
    print(*shapes_data(), sep="\n")
