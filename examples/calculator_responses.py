"""The calculator task as a ChatAgent on the OpenAI Responses API (`client.responses.create`),
the API Codex-style agents speak. Each turn sends only what is new and continues the stored
response by `previous_response_id`.

    instar rollout --agent examples/calculator_responses.py \
        --data.train examples/data/calculator.jsonl
"""

import json

import openai

from instar import ChatAgent, ChatContext, Result
from instar.tasks.tools import CALCULATOR, calculate, score

TOOL = {"type": "function", **CALCULATOR["function"]}  # (Responses tools are flat)


class CalculatorResponses(ChatAgent):
    max_turns = 4

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        new_input, previous = [{"role": "user", "content": ctx.task.prompt}], None
        for _ in range(self.max_turns):
            response = await client.responses.create(model=ctx.model, input=new_input,
                                                     tools=[TOOL], previous_response_id=previous)
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return Result(reward=score(response.output_text, ctx.task.label))
            new_input, previous = [], response.id
            for call in calls:
                try:
                    expression = json.loads(call.arguments).get("expression", "")
                except (json.JSONDecodeError, AttributeError):
                    expression = ""
                new_input.append({"type": "function_call_output", "call_id": call.call_id,
                                  "output": calculate(expression)})
        return Result(reward=0.0, truncated=True)


AgentRunner = CalculatorResponses
