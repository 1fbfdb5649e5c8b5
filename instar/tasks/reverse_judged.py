"""The reverse task graded by a judge model: the reward is the judge's verdict, not the exact score.

    instar rl --agent instar/tasks/reverse_judged.py --agent.judge JUDGE_DIR ...

The judge (`--agent.judge`, a frozen model on an engine of its own) is asked one yes/no
question for each position of the answer, `letter_question(...)`: is the answer's letter the
reference's? All positions are asked at once, and the reward is the share of yeses. The exact
letters-in-place score (instar/tasks/reverse.py) is never shown to the judge; it goes to
`info["exact"]` (logged as rollout/info/exact), so a run shows whether the policy improves or
only pleases the judge. A judge for it: trained on instar/tasks/judge_data.py's questions, and
examined on every pair of letters with `Exam` below before it grades anything.
"""

import asyncio

from instar import Action, Env, Result, Task, parse_score
from instar.tasks.reverse import score

GAP = "none"  # the letter of a position one string lacks (a word: no one letter reads as it)


def letter_question(reference: str, answer: str) -> str:
    """The question for one position. The letters come last, each a token of its own."""
    return ("Is the answer letter the reference letter? Reply yes or no.\n"
            f"Reference letter:{reference}\nAnswer letter:{answer}")


class JudgedReverse(Env):
    max_turns = 1

    async def reset(self, task: Task) -> str:
        if self.judge is None:
            raise ValueError("instar/tasks/reverse_judged.py needs a judge: --agent.judge DIR")
        self.task = task
        return task.prompt

    async def step(self, action: Action) -> Result:
        answer, label = action.text.strip(), self.task.label
        n = max(len(label), len(answer), 1)
        pairs = [(label[i] if i < len(label) else GAP, answer[i] if i < len(answer) else GAP)
                 for i in range(n)]
        verdicts = await asyncio.gather(*(self.judge.ask(
            [{"role": "user", "content": letter_question(x, y)}], max_tokens=4)
            for x, y in pairs))
        return Result(reward=sum(map(parse_score, verdicts)) / n,
                      info={"exact": score(answer, label), "verdict": " ".join(verdicts)})


class Exam(Env):
    """The judge's exam: each task is one letter question, its label the right verdict; the
    reward is 1 when the reply reads (`parse_score`, as the Env reads it) as the label. Every
    question, greedy as the Env asks:

        instar eval --agent instar/tasks/reverse_judged.py:Exam --model.path JUDGE \\
            --data.eval EXAM --eval.size 1000 --eval.temperature 0 --rollout.max-tokens 4
                                                                # EXAM: judge_data()[1]
    """
    max_turns = 1

    async def reset(self, task: Task) -> str:
        self.label = task.label
        return task.prompt

    async def step(self, action: Action) -> Result:
        return Result(reward=float(parse_score(action.text) == parse_score(self.label)))


AgentRunner = JudgedReverse
