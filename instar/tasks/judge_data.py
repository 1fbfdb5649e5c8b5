"""Data for a judge of the reverse task (instar/tasks/reverse_judged.py), generated
deterministically from the reverse data (instar/tasks/reverse_data.py).

    python -m instar.tasks.judge_data    # prints the paths: judge_train, judge_eval, demos,
                                         # checklist_train, checklist_eval

- judge_train: SFT JSONL (`instar sft --data.train ...`) of grading conversations. Each is
  the task's rubric for a reverse train question and a candidate answer, then the verdict
  "Score: N", N the exact letters-in-place score (instar/tasks/reverse.py) times 10, rounded.
  A share of the questions (SHORT) are words of one or two letters, which the task never
  asks. The candidates: the reference itself, copies with k letters wrong, copies cut short or
  run on, the unreversed word, random strings, an empty answer.
- judge_eval: the same for the reverse eval questions (none in judge_train), with the exact
  score as `score`, to measure how well a trained judge agrees with it.
- demos: SFT JSONL of the reverse train tasks answered correctly (the policy's warm-up).
- checklist_train, checklist_eval: SFT JSONL for the checklist rubric (`--agent.config rubric
  checklist`): one position's question, "yes" or "no"; half the answer letters are right.
"""

import json
import random

from instar.tasks.reverse import score
from instar.tasks.reverse_data import LETTERS, reverse_data
from instar.tasks.reverse_judged import GAP, letter_question, rubric
from instar.tasks.tiny_model import cache_root, write_rows

SHORT = 0.3
"""Share of the judge's training conversations about a word of one or two letters."""
OTHERS = "ijklmnopqrstuvwxyz"


def verdict(answer: str, reference: str) -> str:
    """The verdict a perfect judge gives: the exact score on the 0-10 scale, halves up."""
    return f"Score: {int(10 * score(answer, reference) + 0.5)}"


def candidate(reference: str, question_word: str, rng: random.Random) -> str:
    """An answer to grade, drawn to spread the scores from 0 to 10."""
    kind = rng.choices(["right", "wrong", "length", "unreversed", "random", "empty"],
                       [2, 4, 2, 1, 2, 0.3])[0]
    if kind == "right":
        return reference
    if kind == "unreversed":
        return question_word
    if kind == "empty":
        return ""
    if kind == "random":
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 8)))
    answer = list(reference)
    if kind == "length":
        cut = rng.randint(1, 2)
        answer = answer[:-cut] if rng.random() < 0.5 else answer + rng.choices(LETTERS, k=cut)
    for i in rng.sample(range(len(answer)), rng.randint(int(kind == "wrong"), len(answer))):
        answer[i] = rng.choice(LETTERS.replace(answer[i], ""))
    return "".join(answer)


def short(rng: random.Random) -> dict:
    """A reverse task of one or two letters (the task's own are 3-6): on these the judge
    learns to compare a letter with a letter before it learns to add the comparisons up."""
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 2)))
    return {"prompt": f"Reverse: {word}", "label": word[::-1]}


def grading(row: dict, rng: random.Random) -> dict:
    """One grading conversation for a reverse task row, with its exact `score`."""
    word = row["prompt"].removeprefix("Reverse: ")
    answer = candidate(row["label"], word, rng)
    return {"messages": [{"role": "user", "content": rubric(row["prompt"], row["label"], answer)},
                         {"role": "assistant", "content": verdict(answer, row["label"])}],
            "score": score(answer, row["label"])}


def checking(rng: random.Random) -> dict:
    """One checklist conversation: a reference letter (or none, a fifth of the time: the
    answer runs on), an answer letter right half the time, else another letter of the
    task's, a letter it never uses, or none (never both none: the Env does not ask that)."""
    x = rng.choice(LETTERS) if rng.random() > 0.2 else GAP  # the answer runs on
    others = [c for c in LETTERS + GAP + rng.choice(OTHERS) if c != x]
    y = x if x != GAP and rng.random() < 0.5 else rng.choice(others)
    return {"messages": [{"role": "user", "content": letter_question(x, y)},
                         {"role": "assistant", "content": "yes" if x == y else "no"}],
            "score": float(x == y)}


def judge_data(n_train: int = 20000, n_eval: int = 512,
               n_checklist: int = 4000) -> tuple[str, str, str, str, str]:
    """Paths of (judge_train, judge_eval, demos, checklist_train, checklist_eval) JSONL,
    written once into the cache."""
    train_path, eval_path = reverse_data()
    folder = cache_root() / "data" / f"reverse-judge-v4-{n_train}-{n_eval}-{n_checklist}"
    paths = [folder / name for name in ("judge_train.jsonl", "judge_eval.jsonl", "demos.jsonl",
                                        "checklist_train.jsonl", "checklist_eval.jsonl")]
    if not paths[-1].exists():
        rng = random.Random(0)
        train = [json.loads(line) for line in open(train_path)]
        held_out = [json.loads(line) for line in open(eval_path)]
        judged = [grading(rng.choice(train) if rng.random() > SHORT else short(rng), rng)
                  for _ in range(n_train)]
        judged_eval = [grading(rng.choice(held_out), rng) for _ in range(n_eval)]
        demos = [{"messages": [{"role": "user", "content": r["prompt"]},
                               {"role": "assistant", "content": r["label"]}]} for r in train]
        checklist = [checking(rng) for _ in range(n_checklist + n_eval)]
        folder.mkdir(parents=True, exist_ok=True)
        for path, rows in zip(paths, (judged, judged_eval, demos, checklist[:n_checklist],
                                      checklist[n_checklist:])):
            write_rows(path, rows)
    return tuple(str(p) for p in paths)


if __name__ == "__main__":
    print(*judge_data(), sep="\n")
