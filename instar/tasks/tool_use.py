"""The built-in multi-turn tool-use task: look facts up, compute with them, answer.

Each task carries its own small table of facts (`task.data["facts"]`, random numbers about
made-up places), so the answer cannot be memorised: the model has to call `lookup`, then
usually `calculator`, then answer. A typical episode is three model turns:

    user       What is the population of Avalon plus the population of Brill?
    assistant  <tool_call>lookup "population of Avalon"</tool_call><tool_call>lookup ...
    tool       412                      tool  87
    assistant  <tool_call>calculator "412+87"</tool_call>
    tool       499
    assistant  499                      -> reward 1.0 (its last number equals the label)

Data (deterministic JSONL, with a held-out split and SFT demonstrations):
`python -m instar.tasks.tool_use_data`. The same task through the OpenAI SDK, as a
ChatAgent: `examples/tool_use_openai.py`. Written against the public contract, as a user
would. Tasks without facts (e.g. examples/data/calculator.jsonl) get the calculator alone.
"""

from instar import Action, Env, Result, Task
from instar.tasks.tools import CALCULATOR, LOOKUP, call_tool, score


class ToolUse(Env):
    tools = [CALCULATOR, LOOKUP]
    max_turns = 4

    async def reset(self, task: Task):
        self.label, self.facts, self.calls = task.label, task.data.get("facts", {}), 0
        self.tools = [CALCULATOR, LOOKUP] if self.facts else [CALCULATOR]  # nothing to look up
        return task.prompt

    async def step(self, action: Action) -> Result:
        self.calls += len(action.tool_calls)
        info = {"tool_calls": self.calls}
        if action.tool_calls:  # every call runs; their results are the next observation
            results = [{"role": "tool", "content": call_tool(c, self.facts)}
                       for c in action.tool_calls]
            return Result(reward=0.0, observation=results, terminated=False, info=info)
        return Result(reward=score(action.text, self.label), info=info)


AgentRunner = ToolUse
