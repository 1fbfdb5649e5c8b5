"""Data for a judge of the reverse task (instar/tasks/reverse_judged.py), generated
deterministically.

    python -m instar.tasks.judge_data    # prints the paths: train, exam, demos

- train: SFT JSONL (`instar sft --data.train ...`), one letter question each with its verdict:
  a reference letter of the task's (or none: the answer runs on), and an answer letter that is
  the same half the time, else mostly another of the task's letters, sometimes none or any
  printable character.
- exam: task JSONL of every question the Env can ask about a reference letter and a printable
  character (or none), the right verdict as `label`: `Exam` in reverse_judged.py grades a judge
  on it, and a judge that misses any pair is one a policy can exploit.
- demos: SFT JSONL of the reverse train tasks answered correctly (the policy's warm-up).
"""

import json
import random
import string

from instar.tasks.reverse_data import LETTERS, reverse_data
from instar.tasks.reverse_judged import GAP, letter_question
from instar.tasks.tiny_model import cache_root, write_rows

PRINTABLE = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
"""The characters an answer is examined for (white space inside an answer: only the space)."""


def verdict(x: str, y: str) -> str:
    return "yes" if x == y else "no"


def question(rng: random.Random) -> dict:
    """One training conversation for the judge. Most wrong answer letters are the task's own
    letters: telling those apart is what the judge learns last (the other characters it
    learns to refuse early, from their being rarely right)."""
    x = rng.choice(LETTERS) if rng.random() > 0.2 else GAP
    same, y = x != GAP and rng.random() < 0.5, x
    while y == x and not same:
        u = rng.random()
        y = rng.choice(LETTERS) if u < 0.85 else GAP if u < 0.92 else rng.choice(PRINTABLE)
    return {"messages": [{"role": "user", "content": letter_question(x, y)},
                         {"role": "assistant", "content": verdict(x, y)}]}


def judge_data(n_train: int = 20000) -> tuple[str, str, str]:
    """Paths of (train, exam, demos) JSONL, written once into the cache."""
    folder = cache_root() / "data" / f"reverse-judge-v6-{n_train}"
    paths = [folder / name for name in ("train.jsonl", "exam.jsonl", "demos.jsonl")]
    if not paths[-1].exists():
        rng = random.Random(0)
        exam = [{"prompt": letter_question(x, y), "label": verdict(x, y)}
                for x in [*LETTERS, GAP] for y in [*PRINTABLE, GAP] if (x, y) != (GAP, GAP)]
        demos = [{"messages": [{"role": "user", "content": r["prompt"]},
                               {"role": "assistant", "content": r["label"]}]}
                 for r in map(json.loads, open(reverse_data()[0]))]
        folder.mkdir(parents=True, exist_ok=True)
        for path, rows in zip(paths, ([question(rng) for _ in range(n_train)], exam, demos)):
            write_rows(path, rows)
    return tuple(str(p) for p in paths)


if __name__ == "__main__":
    print(*judge_data(), sep="\n")
