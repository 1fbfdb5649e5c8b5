"""The judge's data for the reverse task (instar/tasks/judge_data.py) and the judged Env
(instar/tasks/reverse_judged.py), tokenizer only: the training verdicts are right and balanced,
the exam asks every question the Env can ask about a printable answer, each letter is a token
of its own (" a" would be one token, " b" two), the Env's reward is the share of the judge's
yeses while the exact score only goes to `info`, and `Exam` grades a judge's reply as the Env
reads it."""

import asyncio
import json
import string

import pytest

from instar.agents.contract import Action, Task
from instar.tasks.judge_data import judge_data
from instar.tasks.reverse_data import LETTERS
from instar.tasks.reverse_judged import GAP, Exam, JudgedReverse, letter_question


def rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def letters(question: str) -> tuple[str, str]:
    x, y = (question.split(f"{w} letter:")[1].split("\n")[0] for w in ("Reference", "Answer"))
    return x, y


def test_training_verdicts_and_exam(tokenizer):
    train, exam, demos = (rows(p) for p in judge_data())
    assert len(train) == len(demos) == 20000
    for row in train:
        x, y = letters(row["messages"][0]["content"])
        assert row["messages"][0]["content"] == letter_question(x, y)
        assert row["messages"][1]["content"] == ("yes" if x == y else "no")
        assert x in LETTERS or (x == GAP and y != GAP)
    assert 0.35 < sum(r["messages"][1]["content"] == "yes" for r in train) / len(train) < 0.45
    pairs = {letters(r["prompt"]): r["label"] for r in exam}
    assert len(pairs) == len(exam) == 9 * 96 - 1  # every letter or none against every char
    assert pairs[("d", "d")] == "yes" and pairs[("d", "e")] == pairs[(GAP, "d")] == "no"
    assert sum(label == "yes" for label in pairs.values()) == len(LETTERS)
    for c in string.ascii_letters + string.digits:  # each reaches the judge as one token
        ids = tokenizer(letter_question(c, c))["input_ids"]
        assert ids[-1] == ids[-10] == tokenizer(c)["input_ids"][0], c


class Judge:
    """A stand-in judge with fixed verdicts."""

    def __init__(self, replies: dict[str, str]):
        self.replies, self.asked = replies, []

    async def ask(self, messages, *, max_tokens: int, **kwargs):
        self.asked.append(messages)
        self.max_tokens = max_tokens
        return self.replies[messages[0]["content"]]


def test_reward_is_the_share_of_yeses(tokenizer):
    env = JudgedReverse()
    # a judge that gets the third position wrong (says yes) and the others right
    env.judge = Judge({letter_question("d", "d"): "yes", letter_question("c", "c"): "yes",
                       letter_question("b", "a"): "yes", letter_question("a", GAP): "no"})
    asyncio.run(env.reset(Task(id="abcd", prompt="Reverse: abcd", label="dcba")))
    result = asyncio.run(env.step(Action(text=" dca\n", token_ids=[])))
    assert len(env.judge.asked) == 4
    assert result.reward == 0.75 and result.info["exact"] == 0.5
    assert result.info["verdict"] == "yes yes yes no"
    assert env.judge.max_tokens > len(tokenizer.tokenize("yes"))  # "ye" would read as 0


def test_exam_and_a_run_without_judge():
    exam = Exam()
    asyncio.run(exam.reset(Task(id="0", prompt=letter_question("a", "b"), label="no")))
    assert asyncio.run(exam.step(Action(text="No.", token_ids=[]))).reward == 1.0
    assert asyncio.run(exam.step(Action(text="yes", token_ids=[]))).reward == 0.0
    asyncio.run(exam.reset(Task(id="1", prompt=letter_question("a", "a"), label="yes")))
    assert asyncio.run(exam.step(Action(text="yes", token_ids=[]))).reward == 1.0
    assert asyncio.run(exam.step(Action(text="ye", token_ids=[]))).reward == 0.0
    env = JudgedReverse()
    env.judge = None
    with pytest.raises(ValueError, match="needs a judge: --agent.judge DIR"):
        asyncio.run(env.reset(Task(id="abcd", prompt="Reverse: abcd", label="dcba")))
