"""The calculator task as a ChatAgent driving the model through the OpenAI SDK.

    instar rollout --agent examples/calculator_openai.py --data examples/data/calculator.jsonl
"""

import json

import openai
from calculator_tool import CALCULATOR, calculate, score

from instar import ChatAgent, ChatContext, Result


class CalculatorOpenAI(ChatAgent):
    max_turns = 4

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        messages = [{"role": "user", "content": ctx.task.prompt}]
        for _ in range(self.max_turns):
            reply = (await client.chat.completions.create(
                model=ctx.model, messages=messages, tools=[CALCULATOR])).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return Result(reward=score(reply.content or "", ctx.task.label))
            for call in reply.tool_calls:
                try:
                    expression = json.loads(call.function.arguments).get("expression", "")
                except json.JSONDecodeError:
                    expression = ""
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculate(expression)})
        return Result(reward=0.0, truncated=True)


AgentRunner = CalculatorOpenAI
