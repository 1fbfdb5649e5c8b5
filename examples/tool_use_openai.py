"""The tool-use task (instar/tasks/tool_use.py) as a ChatAgent driving the model through the
OpenAI SDK: it runs the model's calculator and lookup calls until it answers.

    instar rollout --agent examples/tool_use_openai.py --data.train examples/data/calculator.jsonl
    instar rl --agent examples/tool_use_openai.py --data.train TRAIN --data.eval EVAL  # from
        # python -m instar.tasks.tool_use_data  (docs/scenarios.md)
"""

import json

import openai

from instar import ChatAgent, ChatContext, Result
from instar.tasks.tools import CALCULATOR, LOOKUP, call_tool, score


class ToolUseOpenAI(ChatAgent):
    max_turns = 4

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        facts = ctx.task.data.get("facts", {})  # this task's table, behind the lookup tool
        tools = [CALCULATOR, LOOKUP] if facts else [CALCULATOR]
        messages, calls = [{"role": "user", "content": ctx.task.prompt}], 0
        for _ in range(self.max_turns):
            reply = (await client.chat.completions.create(
                model=ctx.model, messages=messages, tools=tools)).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return Result(reward=score(reply.content or "", ctx.task.label),
                              info={"tool_calls": calls})
            for call in reply.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = {}
                calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": call_tool(
                    {"name": call.function.name, "arguments": arguments}, facts)})
        return Result(reward=0.0, truncated=True, info={"tool_calls": calls})


AgentRunner = ToolUseOpenAI
