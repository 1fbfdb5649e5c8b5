"""The shapes task (instar/tasks/shapes.py) as a ChatAgent over the OpenAI SDK: images go
as `image_url` content parts with base64 data URLs.

    python -m instar.tasks.shapes_data      # -> S/train.jsonl S/eval.jsonl
    instar rl --agent examples/shapes_openai.py --model.kind vl \
        --data.train S/train.jsonl --data.eval S/eval.jsonl --train.warmup-sft-steps 0
"""

import base64
import io

import openai

from instar import ChatAgent, ChatContext, Result
from instar.tasks.shapes import score
from instar.tasks.shapes_data import draw


def image_url(shape: list) -> dict:
    buf = io.BytesIO()
    draw(*shape).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


class ShapesOpenAI(ChatAgent):
    max_turns = 2

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        shapes, messages, reward = ctx.task.data["shapes"], [], 0.0
        for shape, question in zip(shapes, [ctx.task.prompt, "And this one?"]):
            messages.append({"role": "user", "content": [image_url(shape),
                                                         {"type": "text", "text": question}]})
            reply = (await client.chat.completions.create(
                model=ctx.model, messages=messages)).choices[0].message
            messages.append({"role": "assistant", "content": reply.content or ""})
            reward += score(reply.content or "", shape[1]) / len(shapes)
        return Result(reward=reward)


AgentRunner = ShapesOpenAI
