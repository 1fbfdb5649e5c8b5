"""Data for the code-execution task (instar/tasks/code_exec.py), generated deterministically.

    python -m instar.tasks.code_exec_data    # prints the paths: train, eval, demos

Each row asks for a one-line function `f` from a family and a constant k ("returns x plus
7"), with `tests` (four calls on random inputs, each with the value f must return, e.g.
`{"call": "f(3)", "expected": 10}`) and `label` (a reference solution, which `instar rl`'s
supervised warm-up learns from). No (family, k) of eval occurs in train.

demos (`code_exec_demos`): SFT JSONL (`instar sft --data.train ...`) of train rows as
conversations: most are the prompt and the reference solution; a share (`fix_share`) are
two attempts: a wrong one (another constant, or another function of the same argument), the
task's report on it, word for word what CodeExec answers, and then the reference solution.
They cover the turn after a failed attempt, which the label-only warm-up never shows. The
wrong attempts are learned too (the SFT loss covers every assistant turn), so a share of
first attempts stay wrong after the warm-up, as in the demos.
"""

import json
import random

from instar.tasks.code_exec import feedback
from instar.tasks.sandbox import ExecResult
from instar.tasks.tiny_model import cache_root, write_rows

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
            write_rows(path, rows)
    return str(train), str(held_out)


def _attempt(code: str, tests: list[dict]) -> tuple[int, list[str]]:
    """Tests passed and the report lines of `code`, one of this module's own one-liners (run
    here, not in the sandbox: no model wrote it), as `run_tests` would report them."""
    scope: dict = {}
    exec(code, scope)
    passed, wrong = 0, []
    for test in tests:
        value = json.loads(json.dumps(eval(test["call"], scope)))
        if value == test["expected"]:
            passed += 1
        else:
            wrong.append(f"{test['call']} returned {value!r}, expected {test['expected']!r}"[:200])
    return passed, wrong


def demo(row: dict, rng: random.Random, fix: bool) -> dict:
    """A train row as an SFT conversation: its prompt and reference solution; with `fix`, a
    wrong first attempt and the task's report on it come before the solution. The wrong
    attempt has weight 0: it is context for the fix, not something to learn to write."""
    family, k = row["id"].split("-")[0], int(row["id"].split("-")[1])
    messages = [{"role": "user", "content": row["prompt"]}]
    while fix:
        arg = FAMILIES[family][0]
        other, wrong_k = family, k
        if rng.random() < 0.25:  # another function of the same argument, the right constant
            other = rng.choice([f for f in FAMILIES if FAMILIES[f][0] == arg and f != family])
        else:  # the right function, another constant (the warmed-up model's usual mistake)
            wrong_k = rng.choice([j for j in KS if j != k])
        code = f"def f({arg}):\n    return {FAMILIES[other][2].format(k=wrong_k)}\n"
        passed, wrong = _attempt(code, row["tests"])
        if passed < len(row["tests"]):  # a wrong attempt must fail a test to be fed back
            report = feedback(passed, len(row["tests"]), wrong, ExecResult(0, "", "", None, 0.0))
            messages += [{"role": "assistant", "content": code, "weight": 0},
                         {"role": "user", "content": report}]
            break
    return {"messages": messages + [{"role": "assistant", "content": row["label"]}]}


def code_exec_demos(n_demos: int = 2000, fix_share: float = 0.25) -> str:
    """Path of the demos JSONL (`demo` of the first `n_demos` train rows, a `fix_share` of
    them with a wrong first attempt), written once into the cache."""
    train, _ = code_exec_data()
    folder = cache_root() / "data" / "code-exec-v3-2000-32"
    path = folder / f"demos-v2-{n_demos}-{fix_share}.jsonl"  # (v2: wrong attempts of weight 0)
    if not path.exists():
        rng = random.Random(1)
        with open(train) as f:
            rows = [json.loads(line) for line, _ in zip(f, range(n_demos))]
        demos = [demo(r, rng, rng.random() < fix_share) for r in rows]
        write_rows(path, demos)
    return str(path)


if __name__ == "__main__":
    print(*code_exec_data(), code_exec_demos(), sep="\n")
