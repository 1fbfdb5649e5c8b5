"""A ChatAgent that compacts its history mid-episode: after two exchanges it replaces the
conversation with a short summary. instar seals the token segment recorded so far and
starts a new one (reason `history_rewritten`); both segments share the episode's reward.

    instar rollout --agent examples/compacting_agent.py --data.train examples/data/calculator.jsonl
"""

import openai

from instar import ChatAgent, ChatContext, Result
from instar.tasks.tools import score


class Compacting(ChatAgent):
    max_turns = 4

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)

        async def ask(messages):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            return reply.choices[0].message.content or ""

        messages = [{"role": "user", "content": ctx.task.prompt}]
        first = await ask(messages)
        messages += [{"role": "assistant", "content": first},
                     {"role": "user", "content": "Check your answer."}]
        second = await ask(messages)
        summary = f"Question: {ctx.task.prompt} Earlier answers: {first[:40]!r}, {second[:40]!r}."
        final = await ask([{"role": "system", "content": summary},
                           {"role": "user", "content": "Give the final answer."}])
        return Result(reward=score(final, ctx.task.label))


AgentRunner = Compacting
