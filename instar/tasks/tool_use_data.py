"""Data for the tool-use task (instar/tasks/tool_use.py), generated deterministically.

    python -m instar.tasks.tool_use_data     # prints the paths: train, eval, demos

- train/eval JSONL rows: `prompt`, `label` (the number), `facts` (this task's table: the
  `needed` entries and two distractors), `kind` (one, sum, diff; a third of train each),
  `id`. No eval question occurs in train (the values are drawn afresh for every row anyway).
- demos: SFT JSONL (`instar sft --data.train ...`) of the ideal tool-using conversation for
  the first train rows: lookups, a calculator call where needed, the answer (the number).
"""

import random

from instar.tasks.tiny_model import cache_root, write_rows
from instar.tasks.tools import CALCULATOR, LOOKUP

PLACES = ["Avalon", "Brill", "Corin", "Dunmore", "Elms", "Fairhold", "Glenn", "Harrow", "Ivel",
          "Jura", "Kestrel", "Lorn"]
FIELDS = ["population", "area"]


def questions() -> list[tuple[str, str, str, str]]:
    """Every (kind, field, place a, place b) the task asks about; b is "" for kind `one`."""
    out = [("one", f, a, "") for f in FIELDS for a in PLACES]
    return out + [(kind, f, a, b) for kind in ("sum", "diff") for f in FIELDS
                  for a in PLACES for b in PLACES if a != b]


def _row(q: tuple[str, str, str, str], rng: random.Random, n: int, low: int = 10,
         high: int = 999) -> dict:
    kind, field, a, b = q
    needed = [f"{field} of {a}"] + ([f"{field} of {b}"] if b else [])
    keys = list(needed)
    while len(keys) < len(needed) + 2:  # two distractors
        key = f"{rng.choice(FIELDS)} of {rng.choice(PLACES)}"
        keys += [key] if key not in keys else []
    facts = {k: rng.randint(low, high) for k in keys}
    x, y = facts[needed[0]], facts[needed[-1]]
    prompt, label = {
        "one": (f"What is the {field} of {a}?", x),
        "sum": (f"What is the {field} of {a} plus the {field} of {b}?", x + y),
        "diff": (f"What is the {field} of {a} minus the {field} of {b}?", x - y)}[kind]
    return {"id": f"{kind}-{field}-{a}-{b}-{n}", "prompt": prompt, "label": label,
            "facts": dict(sorted(facts.items())), "kind": kind, "needed": needed}


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def demo(row: dict) -> dict:
    """The ideal conversation for a row, as an SFT row `{"messages", "tools"}`."""
    values = [row["facts"][k] for k in row["needed"]]
    messages = [{"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": "",
                 "tool_calls": [_call("lookup", key=k) for k in row["needed"]]},
                *({"role": "tool", "content": str(v)} for v in values)]
    if row["kind"] != "one":
        expression = f"{values[0]}{'+' if row['kind'] == 'sum' else '-'}{values[1]}"
        messages += [{"role": "assistant", "content": "",
                      "tool_calls": [_call("calculator", expression=expression)]},
                     {"role": "tool", "content": str(row["label"])}]
    # the bare number: tokenised as in the tool's result, so the model copies tokens as they are
    messages.append({"role": "assistant", "content": str(row["label"])})
    return {"messages": messages, "tools": [CALCULATOR, LOOKUP]}


def tool_use_data(n_train: int = 3000, n_eval: int = 64, n_demos: int = 2000,
                  digits: int = 3) -> tuple[str, str, str]:
    """Paths of (train, eval, demos) JSONL, written once into the cache. Fact values have 2 to
    `digits` digits (10-999 by default); `digits=1` draws them from 1-9 (the measured run's
    setting: docs/scenarios.md)."""
    if digits not in (1, 2, 3):
        raise ValueError(f"digits must be 1, 2 or 3, not {digits}")
    low, high = (1, 9) if digits == 1 else (10, 10 ** digits - 1)
    suffix = "" if digits == 3 else f"-d{digits}"
    folder = cache_root() / "data" / f"tool-use-v2-{n_train}-{n_eval}-{n_demos}{suffix}"
    paths = [folder / name for name in ("train.jsonl", "eval.jsonl", "demos.jsonl")]
    if not paths[-1].exists():
        rng, held_out, by_kind = random.Random(0), [], []
        quota = {"one": n_eval // 16, "sum": (n_eval - n_eval // 16) // 2}  # 4, 30, 30 of 64
        for kind in ("one", "sum", "diff"):
            qs = [q for q in questions() if q[0] == kind]
            rng.shuffle(qs)
            n = quota.get(kind, n_eval - len(held_out))
            held_out += qs[:n]
            by_kind.append(qs[n:])
        eval_rows = [_row(q, rng, 0, low, high) for q in held_out]
        train_rows = [_row(rng.choice(by_kind[n % 3]), rng, n, low, high)
                      for n in range(n_train)]
        demos = [demo(r) for r in train_rows[:n_demos]]
        folder.mkdir(parents=True, exist_ok=True)
        for path, rows in zip(paths, (train_rows, eval_rows, demos)):
            write_rows(path, rows)
    return tuple(str(p) for p in paths)


if __name__ == "__main__":
    import sys
    args = sys.argv[1:]
    if args not in ([], ["--digits", "1"], ["--digits", "2"], ["--digits", "3"]):
        sys.exit("usage: python -m instar.tasks.tool_use_data [--digits 1|2|3]")
    print(*tool_use_data(digits=int(args[1]) if args else 3), sep="\n")
