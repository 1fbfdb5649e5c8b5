"""The reverse task graded by a judge model: the reward is the judge's score, not the exact one.

    instar rl --agent instar/tasks/reverse_judged.py --agent.judge JUDGE_DIR ...
    instar rl ... --agent.config rubric checklist     # one yes/no question per letter

The judge (`--agent.judge`, a frozen model on its own engine) grades the answer against the
reference. With the default `rubric score` it reads `rubric(...)` once: the question, the
reference, the answer, and the two written out letter by letter, one pair a line ("d|d"),
so that a small model can compare them, and replies "Score: N" (0-10). With `rubric
checklist` it is asked `letter_question(...)` once for each position ("yes" or "no"), and the
reward is the share of yeses. The exact letters-in-place score (instar/tasks/reverse.py) is
never shown to the judge; it goes to `info["exact"]` (logged as rollout/info/exact), so a run
shows whether the policy improves or only pleases the judge. Data to teach a judge either
rubric: instar/tasks/judge_data.py.
"""

import asyncio

from instar import Action, Env, Result, Task, parse_score
from instar.tasks.reverse import score

GAP = "-"  # the letter of a position one string lacks


def rubric(question: str, reference: str, answer: str) -> str:
    """The judge's prompt for one answer (stripped of surrounding white space)."""
    n = max(len(reference), len(answer))
    pairs = "\n".join(f"{reference[i] if i < len(reference) else GAP}|"
                      f"{answer[i] if i < len(answer) else GAP}" for i in range(n))
    return ("Score the answer from 0 to 10: the share of its letters in the right place. "
            f"Reply with: Score: N\nQuestion: {question}\nReference: {reference}\n"
            f"Answer: {answer}\nReference|answer, letter by letter:\n{pairs}")


def letter_question(reference: str, answer: str) -> str:
    """The checklist's question for one position ("-": that string has no letter there)."""
    return (f"Reference letter: {reference}\nAnswer letter: {answer}\n"
            "Is the answer letter the reference letter? Reply yes or no.")


class JudgedReverse(Env):
    max_turns = 1

    def __init__(self, rubric: str = "score"):
        if rubric not in ("score", "checklist"):
            raise ValueError(f"--agent.config rubric must be score or checklist, not {rubric!r}")
        self.checklist = rubric == "checklist"

    async def reset(self, task: Task) -> str:
        if self.judge is None:
            raise ValueError("instar/tasks/reverse_judged.py needs a judge: --agent.judge DIR")
        self.task = task
        return task.prompt

    async def step(self, action: Action) -> Result:
        answer, label = action.text.strip(), self.task.label
        if self.checklist:
            n = max(len(label), len(answer), 1)
            pairs = [(label[i] if i < len(label) else GAP, answer[i] if i < len(answer) else GAP)
                     for i in range(n)]
            verdicts = await asyncio.gather(*(self.judge.ask(
                [{"role": "user", "content": letter_question(x, y)}], max_tokens=4)
                for x, y in pairs))
            reward, verdict = sum(map(parse_score, verdicts)) / n, " ".join(verdicts)
        else:
            verdict = await self.judge.ask(
                [{"role": "user", "content": rubric(self.task.prompt, label, answer)}],
                max_tokens=8)
            reward = parse_score(verdict)
        return Result(reward=reward, info={"exact": score(answer, label), "verdict": verdict})


AgentRunner = JudgedReverse
