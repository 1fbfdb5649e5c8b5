"""Data for the code-execution task (instar/tasks/code_exec.py), generated deterministically.

    python -m instar.tasks.code_exec_data    # prints the paths: train, eval

Each row asks for a one-line function `f` from a family and a constant k ("returns x plus
7"), with `tests` (four calls on random inputs, each with the value f must return, e.g.
`{"call": "f(3)", "expected": 10}`) and `label` (a reference solution, which `instar rl`'s
supervised warm-up learns from). No (family, k) of eval occurs in train.
"""

import json
import random

from instar.tasks.tiny_model import cache_root

# family: (argument, what f returns, the reference body)
FAMILIES = {
    "add": ("x", "x plus {k}", "x + {k}"),
    "sub": ("x", "x minus {k}", "x - {k}"),
    "mul": ("x", "x times {k}", "x * {k}"),
    "mod": ("x", "the remainder of x divided by {k}", "x % {k}"),
    "divisible": ("x", "whether x is divisible by {k}", "x % {k} == 0"),
    "repeat": ("s", "the string s repeated {k} times", "s * {k}"),
    "head": ("s", "the first {k} characters of the string s", "s[:{k}]"),
    "tail": ("s", "the last {k} characters of the string s", "s[-{k}:]"),
}
KS = range(2, 21)


def _row(family: str, k: int, rng: random.Random, n: int) -> dict:
    arg, says, body = FAMILIES[family]
    solution = f"def f({arg}):\n    return {body.format(k=k)}\n"
    scope: dict = {}
    exec(solution, scope)
    tests = []
    for i in range(4):  # inputs that tell k from other constants: multiples of k for half
        # the divisibility tests (else False passes), strings longer than k
        x = (k * rng.randint(1, 12) if family == "divisible" and i % 2 else rng.randint(0, 200)) \
            if arg == "x" else "".join(rng.choice("abcxyz") for _ in range(k + rng.randint(1, 8)))
        tests.append({"call": f"f({x!r})", "expected": scope["f"](x)})
    return {"id": f"{family}-{k}-{n}", "label": solution, "tests": tests,
            "prompt": f"Write a Python function f({arg}) that returns {says.format(k=k)}. "
                      "Reply with the code only."}


def code_exec_data(n_train: int = 2000, n_eval: int = 32) -> tuple[str, str]:
    """Paths of (train, eval) JSONL, written once into the cache."""
    folder = cache_root() / "data" / f"code-exec-v3-{n_train}-{n_eval}"
    train, held_out = folder / "train.jsonl", folder / "eval.jsonl"
    if not held_out.exists():
        rng = random.Random(0)
        pairs = [(family, k) for family in FAMILIES for k in KS]
        rng.shuffle(pairs)
        eval_rows = [_row(f, k, rng, 0) for f, k in pairs[:n_eval]]
        train_rows = [_row(*pairs[n_eval + n % (len(pairs) - n_eval)], rng, n)
                      for n in range(n_train)]
        folder.mkdir(parents=True, exist_ok=True)
        for path, rows in ((train, train_rows), (held_out, eval_rows)):
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(path)
    return str(train), str(held_out)


if __name__ == "__main__":
    print(*code_exec_data(), sep="\n")
