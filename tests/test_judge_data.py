"""The judge's data for the reverse task (instar/tasks/judge_data.py) and the judged Env's
reward (instar/tasks/reverse_judged.py), tokenizer only: each verdict is the exact score on the
0-10 scale, the scores spread over the scale, the judge's held-out questions are the task's
own held-out words (3-6 letters, none in its training conversations), each
letter-by-letter line is the same four tokens, and the Env's reward is the judge's verdict
while the exact score only goes to `info`."""

import asyncio
import json
from collections import Counter

import pytest

from instar import parse_score
from instar.agents.contract import Action, Task
from instar.tasks.judge_data import judge_data, verdict
from instar.tasks.reverse import score
from instar.tasks.reverse_judged import JudgedReverse, letter_question, rubric


def rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def question(row: dict) -> str:
    return row["messages"][0]["content"].split("\n")[1]


def test_verdicts_scores_and_split(tokenizer):
    train, held_out, demos, _, _ = (rows(p) for p in judge_data())
    assert len(train) == 20000 and len(held_out) == 512 and len(demos) == 20000
    for row in train[:2000] + held_out:
        text = row["messages"][0]["content"]
        reference = text.split("\nReference: ")[1].split("\n")[0]
        answer = text.split("\nAnswer: ")[1].split("\n")[0]
        assert text == rubric(question(row).removeprefix("Question: "), reference, answer)
        assert row["messages"][1]["content"] == verdict(answer, reference)
        assert row["score"] == score(answer, reference)
    assert verdict("abcd", "abdd") == "Score: 8" and verdict("abcd", "abcd") == "Score: 10"
    spread = Counter(row["messages"][1]["content"] for row in train)
    assert {f"Score: {n}" for n in range(11)} <= set(spread)
    assert max(spread.values()) < 0.4 * len(train)  # no verdict right in most conversations
    seen = {question(r) for r in train}
    assert not any(question(r) in seen for r in held_out)
    words = [q.removeprefix("Question: Reverse: ") for q in map(question, train)]
    assert 0.25 < sum(len(w) <= 2 for w in words) / len(words) < 0.35  # the short words
    assert all(3 <= len(question(r).removeprefix("Question: Reverse: ")) <= 6 for r in held_out)
    lines = ["".join(p) for p in zip("abcdefgh-", "hgfedcba-")] + ["dd", "aa", "a-", "-h"]
    for line in lines:  # "x|y\n" is four tokens, whatever the letters: one layout a line
        assert len(tokenizer.tokenize(f"{line[0]}|{line[1]}\n")) == 4


def test_checklist_data():
    train, held_out = (rows(p) for p in judge_data()[3:])
    assert len(train) == 4000 and len(held_out) == 512
    for row in train + held_out:
        text = row["messages"][0]["content"]
        x, y = (text.split(f"{w} letter: ")[1][0] for w in ("Reference", "Answer"))
        assert text == letter_question(x, y)
        assert row["messages"][1]["content"] == ("yes" if x == y else "no")
    assert 0.35 < sum(r["messages"][1]["content"] == "yes" for r in train) / len(train) < 0.5
    gaps = [r["messages"][0]["content"] for r in train if "Reference letter: -" in
            r["messages"][0]["content"]]  # the answer runs on: the judge must say no
    assert len(gaps) > 600 and not any("Answer letter: -" in text for text in gaps)


class Judge:
    """A stand-in judge that always gives the same verdict."""

    def __init__(self, reply: str | dict[str, str]):
        self.reply, self.asked = reply, []

    async def ask(self, messages, *, max_tokens: int, **kwargs):
        self.asked.append(messages)
        self.max_tokens = max_tokens
        text = messages[0]["content"]
        return self.reply if isinstance(self.reply, str) else self.reply[text]


def test_judged_reward_is_the_verdict(tokenizer):
    env = JudgedReverse()
    env.judge = Judge("Score: 3")
    task = Task(id="abcd", prompt="Reverse: abcd", label="dcba")
    asyncio.run(env.reset(task))
    result = asyncio.run(env.step(Action(text=" dcbb\n", token_ids=[])))
    assert result.reward == parse_score("Score: 3") == 0.3
    assert result.info["exact"] == 0.75 and result.info["verdict"] == "Score: 3"
    [messages] = env.judge.asked
    assert messages[0]["content"] == rubric("Reverse: abcd", "dcba", "dcbb")
    assert messages[0]["content"].endswith("letter by letter:\nd|d\nc|c\nb|b\na|b")
    assert env.judge.max_tokens > len(tokenizer.tokenize("Score: 10"))  # room for any verdict


def test_checklist_reward_is_the_share_of_yeses(tokenizer):
    env = JudgedReverse(rubric="checklist")
    # a judge that gets the third position wrong (says yes) and the others right
    env.judge = Judge({letter_question("d", "d"): "yes", letter_question("c", "c"): "yes",
                       letter_question("b", "a"): "yes", letter_question("a", "-"): "no"})
    asyncio.run(env.reset(Task(id="abcd", prompt="Reverse: abcd", label="dcba")))
    result = asyncio.run(env.step(Action(text="dca", token_ids=[])))
    assert len(env.judge.asked) == 4
    assert result.reward == 0.75 and result.info["exact"] == 0.5
    assert result.info["verdict"] == "yes yes yes no"
    assert env.judge.max_tokens > len(tokenizer.tokenize("yes"))  # "ye" would read as 0


def test_judged_env_refuses_a_bad_rubric_and_a_run_without_judge():
    with pytest.raises(ValueError, match="rubric must be score or checklist, not 'bogus'"):
        JudgedReverse(rubric="bogus")
    env = JudgedReverse()
    env.judge = None
    with pytest.raises(ValueError, match="needs a judge: --agent.judge DIR"):
        asyncio.run(env.reset(Task(id="abcd", prompt="Reverse: abcd", label="dcba")))
