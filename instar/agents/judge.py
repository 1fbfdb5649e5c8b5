"""LLM-as-judge: a model on instar's own engines that an agent asks for a verdict.

    class Graded(Env):
        async def step(self, action):
            verdict = await self.judge.ask([{"role": "user", "content": f"Rate: {action.text}"}])
            return Result(reward=parse_score(verdict), info={"verdict": verdict})

The run chooses the judge (`--agent.judge`): `policy` (the policy's own engines, so its
current weights) or a Hugging Face folder (a frozen model on an engine of its own). Every
Env or ChatAgent instance gets it as `self.judge` (None when the run has no judge). The
judge's generations are never training tokens: they are not part of the episode. No torch,
no ray: the run hands the judge a `generate` function.
"""

import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from instar.agents.chat import Message, prompt_ids

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Judge:
    """Ask a judge model; `ask` renders the messages with the judge's own chat template."""

    def __init__(self, generate: Callable[[list[int], dict[str, Any]], Awaitable[Any]],
                 tokenizer):
        self._generate, self.tokenizer = generate, tokenizer
        self._lock = threading.Lock()  # episodes ask from threads of their own
        self.calls = 0
        """Verdicts returned so far (all episodes of the run)."""

    async def ask(self, messages: list[Message], *, max_tokens: int = 32,
                  temperature: float = 0.0) -> str:
        """The judge's reply to `messages` (chat dicts). Temperature 0 is greedy, so the same
        question gets the same verdict from the same weights."""
        ids = prompt_ids(self.tokenizer, messages, None)
        gen = await self._generate(ids, {"max_tokens": max_tokens, "temperature": temperature})
        with self._lock:
            self.calls += 1
        return gen.text


def parse_score(verdict: str, scale: float = 10.0) -> float:
    """A verdict as a reward in [0, 1]: a first word "yes" or "no" gives 1 or 0; otherwise the
    first number divided by `scale` ("Score: 7/10" -> 0.7), clamped; 0 when there is none."""
    words = verdict.strip().lower().split()
    first = words[0].strip(".,!:;") if words else ""
    if first in ("yes", "no"):
        return float(first == "yes")
    match = _NUMBER.search(verdict)
    return min(max(float(match.group()) / scale, 0.0), 1.0) if match else 0.0
