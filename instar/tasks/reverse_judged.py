"""The reverse task graded by a judge model: the reward is the judge's score, not the exact one.

    instar rl --agent instar/tasks/reverse_judged.py --agent.judge JUDGE_DIR ...

The judge (`--agent.judge`, a frozen model on its own engine) reads `rubric(...)`: the
question, the reference, the answer, and the two written out letter by letter, one pair a
line ("d|d"), so that a small model can compare them. It replies "Score: N" (0-10). The exact
letters-in-place score (instar/tasks/reverse.py) is never shown to the judge; it goes to
`info["exact"]` (logged as rollout/info/exact), so a run shows whether the policy improves
or only pleases the judge. A judge for this rubric: instar/tasks/judge_data.py.
"""

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


class JudgedReverse(Env):
    max_turns = 1

    async def reset(self, task: Task) -> str:
        if self.judge is None:
            raise ValueError("instar/tasks/reverse_judged.py needs a judge: --agent.judge DIR")
        self.task = task
        return task.prompt

    async def step(self, action: Action) -> Result:
        answer = action.text.strip()
        verdict = await self.judge.ask(
            [{"role": "user", "content": rubric(self.task.prompt, self.task.label, answer)}],
            max_tokens=6)
        return Result(reward=parse_score(verdict),
                      info={"exact": score(answer, self.task.label), "verdict": verdict})


AgentRunner = JudgedReverse
