"""LLM-as-judge: the reward of an answer is a judge model's rating of it.

    instar rl --agent examples/judge_env.py --agent.judge policy ...   # the policy judges
    instar rl --agent examples/judge_env.py --agent.judge DIR ...      # a frozen model judges

The judge (`self.judge`, set by instar from `--agent.judge`) runs on instar's own engines;
what it generates is never trained on. Any data with `prompt` and `label` works, e.g.
examples/data/calculator.jsonl.
"""

from instar import Action, Env, Result, Task, parse_score


class Judged(Env):
    max_turns = 1
    rubric = ("Question: {question}\nReference answer: {label}\nAnswer: {answer}\n"
              "Rate the answer from 0 to 10. Reply with: Score: N")

    async def reset(self, task: Task):
        if self.judge is None:
            raise ValueError("examples/judge_env.py needs a judge: --agent.judge policy or DIR")
        self.task = task
        return task.prompt

    async def step(self, action: Action) -> Result:
        question = self.rubric.format(question=self.task.prompt, label=self.task.label,
                                      answer=action.text.strip())
        verdict = await self.judge.ask([{"role": "user", "content": question}], max_tokens=8)
        return Result(reward=parse_score(verdict), info={"verdict": verdict})


AgentRunner = Judged
