"""The calculator task as a ChatAgent driving the model through the Anthropic SDK.

    instar rollout --agent examples/calculator_anthropic.py \
        --data.train examples/data/calculator.jsonl
"""

import anthropic

from instar import ChatAgent, ChatContext, Result
from instar.tasks.tools import CALCULATOR, calculate, score

TOOL = {"name": CALCULATOR["function"]["name"],
        "description": CALCULATOR["function"]["description"],
        "input_schema": CALCULATOR["function"]["parameters"]}


class CalculatorAnthropic(ChatAgent):
    max_turns = 4

    async def run(self, ctx: ChatContext) -> Result:
        client = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
        messages = [{"role": "user", "content": ctx.task.prompt}]
        for _ in range(self.max_turns):
            reply = await client.messages.create(model=ctx.model, max_tokens=256,
                                                 messages=messages, tools=[TOOL])
            messages.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                text = "".join(b.text for b in reply.content if b.type == "text")
                return Result(reward=score(text, ctx.task.label))
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id,
                 "content": calculate(u.input.get("expression", ""))} for u in uses]})
        return Result(reward=0.0, truncated=True)


AgentRunner = CalculatorAnthropic
