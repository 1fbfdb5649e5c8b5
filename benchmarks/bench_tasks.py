"""The workloads of benchmarks/bench.py and the agents they run, shared by both sides.

Agent-facing (no torch, no ray): instar loads the Env classes below as its agent; the TRL
side (benchmarks/bench_trl.py) imports the same reward and the same turn rule.

  grpo-small  one turn: "Reverse: abcd" -> the answer; reward = fraction of letters right
  agentic     4 model turns; each turn that ends its message is one tool call taking 50 ms,
              whose result is the next string to reverse (its letters shifted by one)
  long        one turn, few samples, 1024 new tokens each (fixed length)
"""

import asyncio
from dataclasses import dataclass

from instar import Action, Env, Result, Task
from instar.tasks.reverse import score
from instar.tasks.reverse_data import LETTERS


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int
    group_size: int
    max_tokens: int
    """Most new tokens per model turn."""
    steps: int
    """Measured steps."""
    warmup_steps: int
    """Steps run first and not measured (engine warm-up, allocator, first compilations)."""
    turns: int = 1
    tool_latency_s: float = 0.0
    sft_steps: int = 0
    """Supervised warm-up (instar's, on the prompts' labels) that makes the model end its
    turns with an end-of-turn token, so that episodes go on to the next turn; both sides
    start from the warmed-up weights."""
    dtype: str = "float32"
    lr: float = 1e-5
    fixed_length: bool = False
    """Every response runs to `max_tokens` (end-of-turn tokens do not stop it), on both sides."""

    @property
    def agent(self) -> str:
        return "ToolTurns" if self.turns > 1 else "SingleTurn"


SFT_STEPS = 30  # the same in full and quick runs, so both share one cached warm-up

WORKLOADS = {
    "grpo-small": Workload(16, 8, 128, steps=10, warmup_steps=2),
    "grpo-small-bf16": Workload(16, 8, 128, steps=10, warmup_steps=2, dtype="bfloat16"),
    "agentic": Workload(16, 8, 24, steps=10, warmup_steps=2, turns=4, tool_latency_s=0.05,
                        sft_steps=SFT_STEPS),
    "long": Workload(4, 4, 1024, steps=5, warmup_steps=1, fixed_length=True),
}
QUICK = {  # reduced forms for --quick: all of them in under 10 minutes on 2 cores
    "grpo-small": Workload(4, 8, 64, steps=3, warmup_steps=1),
    "grpo-small-bf16": Workload(4, 8, 64, steps=3, warmup_steps=1, dtype="bfloat16"),
    "agentic": Workload(4, 8, 24, steps=2, warmup_steps=1, turns=4, tool_latency_s=0.05,
                        sft_steps=SFT_STEPS),
    "long": Workload(2, 2, 384, steps=2, warmup_steps=1, fixed_length=True),
}


def shift(s: str) -> str:
    """The next turn's string: every letter moved one place on (h wraps to a)."""
    return "".join(LETTERS[(LETTERS.index(c) + 1) % len(LETTERS)] for c in s)


def tool_result(s: str) -> list[dict]:
    return [{"role": "tool", "content": f"Reverse: {shift(s)}"}]


class SingleTurn(Env):
    max_turns = 1

    async def reset(self, task: Task) -> str:
        self.label = task.label
        return task.prompt

    async def step(self, action: Action) -> Result:
        return Result(reward=score(action.text, self.label))


class ToolTurns(Env):
    """Each model turn is taken as one tool call (whatever its text): the call takes
    `latency_s`, and its result asks to reverse the next string. Each turn earns its score
    / `turns`. An episode ends after `turns` turns, or earlier when a turn runs out of
    tokens (no end-of-turn token: instar does not continue a cut-off message)."""

    def __init__(self, turns: str = "4", latency_s: str = "0.05"):
        super().__init__()
        self.max_turns, self.latency_s = int(turns), float(latency_s)

    async def reset(self, task: Task) -> str:
        self.s, self.turn = task.prompt.removeprefix("Reverse: "), 0
        return task.prompt

    async def step(self, action: Action) -> Result:
        reward, self.turn = score(action.text, self.s[::-1]) / self.max_turns, self.turn + 1
        if self.turn == self.max_turns:
            return Result(reward=reward, info={"turns": self.turn})
        await asyncio.sleep(self.latency_s)  # the tool call
        observation, self.s = tool_result(self.s), shift(self.s)
        return Result(reward=reward, observation=observation, terminated=False,
                      info={"turns": self.turn})
