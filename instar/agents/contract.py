"""The public agent contract: what a user's agent file imports from `instar`.

An agent file exposes `AgentRunner`, an `Env` subclass (instar runs the LLM loop) or a
`ChatAgent` subclass (the program drives the model through a stock SDK). Nothing here
imports torch or ray: an agent is an ordinary Python program.
"""

from dataclasses import dataclass, field
from typing import Any

from instar.agents.judge import Judge

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Task:
    """One dataset row."""

    prompt: str | list[Message]
    """The first user message, or a whole list of chat messages."""
    label: Any = None
    """The reference answer, if the row has one (column `label`)."""
    id: str = ""
    """A stable id for the row (column `id`, else its position in the file)."""
    data: dict[str, Any] = field(default_factory=dict)
    """The whole row, for anything else the agent needs."""


@dataclass(frozen=True, slots=True)
class Action:
    """What the model produced in one turn."""

    text: str
    """The decoded completion (reasoning and tool-call markup included)."""
    token_ids: list[int]
    """The exact ids the engine sampled."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """Parsed tool calls, each `{"name": str, "arguments": dict}` (by the run's
    --model.tool-parser, or by `Env.parse_tool_calls` where the Env overrides it)."""
    reasoning: str | None = None
    """The reasoning ("thinking") by --model.reasoning-parser; None when there is none."""
    content: str = ""
    """The reply: `text` without its reasoning and without the parsed tool calls' markup."""


@dataclass(slots=True)
class Result:
    """What the environment (or a ChatAgent's run) returns."""

    reward: float
    """Reward for this step (Env) or for the whole episode (ChatAgent)."""
    observation: str | list[Message] | None = None
    """Next turn's input: a user message as a string, or messages such as role `tool`."""
    terminated: bool = True
    """The episode reached its natural end."""
    truncated: bool = False
    """The episode was cut short (turn, token or time limit)."""
    info: dict[str, float | int | str | bool] = field(default_factory=dict)
    """Scalars to log with the rollout."""
    images: list[Any] = field(default_factory=list)
    """Images that come with the next observation."""


@dataclass(frozen=True, slots=True)
class ChatContext:
    """What a ChatAgent gets: a task and where to reach the model."""

    task: Task
    openai_base_url: str
    """Ends in `/v1`; pass as `base_url` to `openai.AsyncOpenAI`."""
    anthropic_base_url: str
    """No `/v1`; pass as `base_url` to `anthropic.AsyncAnthropic`."""
    api_key: str
    model: str
    sampling: dict[str, Any]
    """The run's sampling settings (temperature, top_p, max_tokens)."""


class Env:
    """A Gymnasium-style environment; instar renders messages and runs the model.

    Subclass it, set `tools` (OpenAI function schemas) if the model may call tools, and
    implement `reset` and `step`. One instance serves one episode.
    """

    tools: list[dict[str, Any]] = []
    max_turns: int = 1
    """Turns of model output per episode before it is truncated."""
    max_tokens: int = 4096
    """Tokens (prompt, generations and observations) per episode before it is truncated."""
    timeout_s: float = 600.0
    """Wall-clock seconds per episode; an episode that runs over counts as failed."""
    judge: Judge | None = None
    """The run's judge model (`--agent.judge`; see instar/agents/judge.py), set by instar
    before `reset`; None when the run has none."""

    def __init__(self, **agent_config: Any):
        self.config = agent_config

    async def reset(self, task: Task) -> str | list[Message]:
        raise NotImplementedError

    async def step(self, action: Action) -> Result:
        raise NotImplementedError

    def parse_tool_calls(self, text: str) -> list[dict[str, Any]] | None:
        """Tool calls in the model's output (`Action.text`); None: the engine's, by the run's
        --model.tool-parser (vLLM's parsers). Override only for a format no vLLM parser reads."""
        return None


class ChatAgent:
    """A program that talks to the model through the OpenAI or Anthropic SDK.

    Implement `run(ctx)`; call the model at `ctx.openai_base_url` or
    `ctx.anthropic_base_url` and return a `Result` with the episode's reward.
    """

    max_turns: int = 16
    max_tokens: int = 4096
    timeout_s: float = 600.0
    judge: Judge | None = None
    """The run's judge model, as for `Env.judge`."""

    def __init__(self, **agent_config: Any):
        self.config = agent_config

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError
