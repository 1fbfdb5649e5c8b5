"""A multi-turn tool-use Env: the model may call a calculator, then answers.

    instar rollout --agent examples/calculator_env.py --data.train examples/data/calculator.jsonl
"""

from instar import Action, Env, Result, Task
from instar.tasks.tools import CALCULATOR, calculate, score


class Calculator(Env):
    tools = [CALCULATOR]
    max_turns = 4

    async def reset(self, task: Task):
        self.label = task.label
        return task.prompt

    async def step(self, action: Action) -> Result:
        if action.tool_calls:  # run every call; their results are the next observation
            results = [{"role": "tool", "content": calculate(c["arguments"].get("expression", ""))}
                       for c in action.tool_calls]
            return Result(reward=0.0, observation=results, terminated=False)
        return Result(reward=score(action.text, self.label))


AgentRunner = Calculator
