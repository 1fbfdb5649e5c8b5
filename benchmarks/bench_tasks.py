"""The workloads of benchmarks/bench.py and the agents they run, shared by both sides.

Agent-facing (no torch, no ray): instar loads the Env classes below as its agent; the TRL
side (benchmarks/bench_trl.py) imports the same reward and the same turn rule.

  grpo-small    one turn: "Reverse: abcd" -> the answer; reward = fraction of letters right
  agentic       4 model turns; each turn that ends its message is one tool call taking 50 ms,
                whose result is the next string to reverse (its letters shifted by one)
  agentic-tail  as agentic, but each episode takes 1-8 turns (drawn uniformly) and each tool
                call's latency is log-normal, as real tools' are: median 0.3 s, p99 5 s
  long          one turn, few samples, 1024 new tokens each (fixed length)

An episode's turn count and tool latencies come from `episode_plan`, seeded by (task id,
sample index): both sides draw the same ones for the same episode.
"""

import asyncio
import math
import random
import threading
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
    """Model turns per episode (the most, with `min_turns`)."""
    min_turns: int | None = None
    """Fewest turns: each episode's count is drawn uniformly from min_turns..turns. None: always
    `turns`."""
    tool_latency_s: float = 0.0
    """Median seconds of a tool call."""
    latency_sigma: float = 0.0
    """Sigma of the log-normal tool latency; 0: every call takes `tool_latency_s`."""
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

    @property
    def plan(self) -> dict:
        """`episode_plan`'s settings, but for the seed."""
        return dict(turns=self.turns, min_turns=self.min_turns or self.turns,
                    latency_s=self.tool_latency_s, sigma=self.latency_sigma)


SFT_STEPS = 30  # the same in full and quick runs, so both share one cached warm-up
TAIL_SIGMA = math.log(5 / 0.3) / 2.326  # ~1.21: p99 (z = 2.326) at 5 s for a 0.3 s median

WORKLOADS = {  # per run; bench.py runs each side --rounds times (default 2), steps pooled
    "grpo-small": Workload(16, 8, 128, steps=5, warmup_steps=1),
    "grpo-small-bf16": Workload(16, 8, 128, steps=5, warmup_steps=1, dtype="bfloat16"),
    "agentic": Workload(16, 8, 24, steps=5, warmup_steps=1, turns=4, tool_latency_s=0.05,
                        sft_steps=SFT_STEPS),
    "agentic-tail": Workload(16, 8, 24, steps=5, warmup_steps=1, turns=8, min_turns=1,
                             tool_latency_s=0.3, latency_sigma=TAIL_SIGMA, sft_steps=SFT_STEPS),
    "long": Workload(4, 4, 1024, steps=3, warmup_steps=1, fixed_length=True),
}
QUICK = {  # reduced forms for --quick: all of them in under 10 minutes on 2 cores
    "grpo-small": Workload(4, 8, 64, steps=3, warmup_steps=1),
    "grpo-small-bf16": Workload(4, 8, 64, steps=3, warmup_steps=1, dtype="bfloat16"),
    "agentic": Workload(4, 8, 24, steps=2, warmup_steps=1, turns=4, tool_latency_s=0.05,
                        sft_steps=SFT_STEPS),
    "agentic-tail": Workload(4, 8, 24, steps=2, warmup_steps=1, turns=8, min_turns=1,
                             tool_latency_s=0.3, latency_sigma=TAIL_SIGMA, sft_steps=SFT_STEPS),
    "long": Workload(2, 2, 384, steps=2, warmup_steps=1, fixed_length=True),
}


def shift(s: str) -> str:
    """The next turn's string: every letter moved one place on (h wraps to a)."""
    return "".join(LETTERS[(LETTERS.index(c) + 1) % len(LETTERS)] for c in s)


def tool_result(s: str) -> list[dict]:
    return [{"role": "tool", "content": f"Reverse: {shift(s)}"}]


def episode_plan(task_id: str, sample: int, turns: int, min_turns: int, latency_s: float,
                 sigma: float) -> tuple[int, list[float]]:
    """The episode's turn count and its tool calls' latencies in seconds (one call after each
    turn but the last), drawn from a seed of (task id, sample index) alone."""
    rng = random.Random(f"{task_id}/{sample}")  # (a str seed is hashed the same in every process)
    n = rng.randint(min_turns, turns)
    return n, [latency_s * math.exp(sigma * rng.gauss(0, 1)) for _ in range(n - 1)]


class SingleTurn(Env):
    max_turns = 1

    async def reset(self, task: Task) -> str:
        self.label = task.label
        return task.prompt

    async def step(self, action: Action) -> Result:
        return Result(reward=score(action.text, self.label))


class ToolTurns(Env):
    """Each model turn is taken as one tool call (whatever its text): the call takes its
    latency from `episode_plan`, and its result asks to reverse the next string. Each turn
    earns its score / the episode's turns. An episode ends after its planned turns, or earlier
    when a turn runs out of tokens (no end-of-turn token: instar does not continue a cut-off
    message).

    The sample index of `episode_plan` is the order in which this process starts a task's
    episodes: all of a run's episodes start here, each task's group once (no evaluation, no
    restarts: partial rollouts resume rather than restart); instar loads the agent file
    afresh for each run, so each run counts from 0, as TRL's process does."""

    started: dict[str, int] = {}
    lock = threading.Lock()  # (resets run on the episodes' own threads)

    def __init__(self, turns: str = "4", min_turns: str = "4", latency_s: str = "0.05",
                 sigma: str = "0"):
        super().__init__()
        self.plan = dict(turns=int(turns), min_turns=int(min_turns), latency_s=float(latency_s),
                         sigma=float(sigma))

    async def reset(self, task: Task) -> str:
        with self.lock:
            sample = self.started.get(task.id, 0)
            self.started[task.id] = sample + 1
        self.max_turns, self.latencies = episode_plan(task.id, sample, **self.plan)
        self.s, self.turn, self.tool_s = task.prompt.removeprefix("Reverse: "), 0, 0.0
        return task.prompt

    async def step(self, action: Action) -> Result:
        reward, self.turn = score(action.text, self.s[::-1]) / self.max_turns, self.turn + 1
        if self.turn == self.max_turns:
            return Result(reward=reward, info={"turns": self.turn, "tool_s": self.tool_s})
        await asyncio.sleep(self.latencies[self.turn - 1])  # the tool call
        self.tool_s += self.latencies[self.turn - 1]
        observation, self.s = tool_result(self.s), shift(self.s)
        return Result(reward=reward, observation=observation, terminated=False,
                      info={"turns": self.turn, "tool_s": self.tool_s})
