"""Token-exact capture of one ChatAgent episode (one gateway session).

    request 1: [sys, user]                 -> render all            -> prompt ids   (mask 0)
                                              engine                -> sampled ids  (mask 1)
    request 2: [sys, user, asst, tool]     extends what we recorded -> render the history
                                              [sys, user, asst] (kept) and [sys, tool]; the
                                              text after asst's end of turn is tokenised and
                                              appended after the sampled ids
    request 3: [.., tool, asst, user]      extends it again         -> render [sys, tool, asst]
                                              and [sys, user] only: the kept text grows
    request 4: [sys, summary, user]        rewrites history         -> seal segment 0,
                                              segment 1 starts from a full render

Rendering only the new messages (each with the first) needs a chat template that renders each
message on its own; with another template each continued turn renders the conversation twice.
Either way the ids are the same (`continuation` in instar/agents/chat.py).

An assistant turn extends the record only when the client sends it back as it was answered:
its text, its tool calls and its reasoning (OpenAI `reasoning_content`, Anthropic `thinking`
blocks). A client that drops the reasoning rewrites history (a new segment, rendered from what
it sent); the sampled reasoning tokens are trained either way.
A retried identical request is answered from the previous reply and not recorded twice.
Nothing is recorded until a request is accepted, so a refused request changes nothing.
With images, each request sends all of the conversation's images; the segment takes the
prompt as the engine expanded their placeholders (see instar/rollout/engine.py).
"""

import json
import time
from dataclasses import dataclass, field
from typing import Any

from instar.agents.chat import Message, Rendered, canonical, continuation, prompt_ids
from instar.sample import Sample, fit_routing


@dataclass
class Segment:
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    sealed_because: str = ""
    routing: list | None = None
    """MoE: the experts of every position the engine ran at the last turn (GPU engines)."""

    def extend(self, ids: list[int], logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        generated = logprobs is not None
        self.tokens += ids
        self.loss_mask += [generated] * len(ids)
        self.logprobs += logprobs if generated else [None] * len(ids)
        self.versions += versions if generated else [None] * len(ids)


@dataclass
class Turn:
    """What an accepted request asks the engine for."""

    prompt_ids: list[int]
    new_segment: str | None
    """Why a new segment starts here (None: the current one is extended)."""
    key: str
    images: list[str] = field(default_factory=list)
    """Data URLs of the conversation's images, in order."""
    rendered: Rendered | None = None
    """The history's text, kept for the next turn when this one is recorded."""


class Session:
    """State of one episode; the gateway calls `plan`, then `record` after generating."""

    def __init__(self, tokenizer, rollout_id: str, group_id: str, sampling: dict[str, Any],
                 max_turns: int, max_tokens: int):
        self.tokenizer, self.rollout_id, self.group_id = tokenizer, rollout_id, group_id
        self.sampling, self.max_turns, self.max_tokens = sampling, max_turns, max_tokens
        self.truncated: str | None = None
        """The limit (max_turns or max_tokens) that refused a request, if one did."""
        self.requeued = False
        """A weight update stopped the episode; it will be restarted."""
        self.failed: Exception | None = None
        """The episode failed outside the agent's code (the model sampled an image placeholder)."""
        self.segments: list[Segment] = []
        self.history: list[Message] = []  # canonical messages up to the last reply
        self.rendered: Rendered | None = None  # (a start of the history, as rendered)
        self.tools: list[dict] | None = None
        self.last_key, self.last_reply = "", None
        self.ended_with_eos, self.finish_reason, self.turns = True, "stop", 0
        self.tool_call_errors = self.tool_calls = 0
        """Tool calls the model began that did not parse, and those that did, over the
        episode's turns."""
        self.responses: dict[str, list[dict]] = {}
        """Responses wire: each stored response's conversation (instructions left out), for
        a later previous_response_id."""
        self.generating_since: float | None = None
        """When the request now with the engine went to it (time.monotonic); None: none is."""

    def where(self) -> str:
        """Where a timed-out episode was waiting: on the engine, or on the agent's side."""
        if self.generating_since is not None:
            return (f"its request {self.turns + 1} had been with the engine for "
                    f"{time.monotonic() - self.generating_since:.0f}s")
        return (f"no request with the engine ({self.turns} answered): the agent's own code, or "
                "a request the gateway had not read")

    def plan(self, messages: list[Message], tools: list[dict] | None, options: Any = None) -> Turn:
        """`options`: the request's other fields that shape the reply (max_tokens, stop): a
        retry is answered from the cache only if they are the same too."""
        msgs = [canonical(m) for m in messages]
        key = json.dumps([msgs, tools, options], sort_keys=True)
        images = [p["image"] for m in msgs if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]
        if not self.segments:
            return Turn(prompt_ids(self.tokenizer, msgs, tools), "start", key, images)
        reason = None
        if tools != self.tools:
            reason = "tools_changed"
        elif msgs[:len(self.history)] != self.history:
            reason = "history_rewritten"
        if reason is None:
            ids, rendered = continuation(self.tokenizer, self.history, msgs, tools,
                                         self.ended_with_eos, self.rendered)
            if ids is not None:
                return Turn(self.segments[-1].tokens + ids, None, key, images, rendered)
            reason = "template_rewrites_history"
        return Turn(prompt_ids(self.tokenizer, msgs, tools), reason, key, images)

    def over_limit(self, turn: Turn) -> str | None:
        """Which per-episode limit a new turn would break, if any (it is then refused)."""
        if self.turns >= self.max_turns:
            return "max_turns"
        if len(turn.prompt_ids) >= self.max_tokens:
            return "max_tokens"
        return None

    def is_retry(self, turn: Turn) -> bool:
        return self.last_reply is not None and turn.key == self.last_key

    def record(self, turn: Turn, messages: list[Message], tools: list[dict] | None, gen,
               reply: Message, response: Any) -> None:
        """Commit an answered turn: its new context ids, then the sampled ids."""
        if turn.new_segment is not None:
            if self.segments:
                self.segments[-1].sealed_because = turn.new_segment
            self.segments.append(Segment())
        seg = self.segments[-1]
        seg.extend((gen.prompt_ids or turn.prompt_ids)[len(seg.tokens):])  # (images expanded)
        seg.extend(list(gen.token_ids), list(gen.logprobs), list(gen.versions))
        seg.images, seg.routing = turn.images, gen.routed_experts
        self.history = [canonical(m) for m in messages] + [canonical(reply)]
        self.rendered = turn.rendered
        self.tools = tools
        self.ended_with_eos = gen.token_ids[-1:] == [self.tokenizer.eos_token_id]
        self.finish_reason, self.turns = gen.finish_reason, self.turns + 1
        self.tool_call_errors += gen.tool_call_errors
        self.tool_calls += len(gen.tool_calls)
        self.last_key, self.last_reply = turn.key, response

    def samples(self, reward: float, info: dict[str, Any], task_id: str = "") -> list[Sample]:
        """One Sample per segment; all share the episode's reward and rollout id."""
        finish = self.truncated or self.finish_reason
        return [Sample(rollout_id=self.rollout_id, group_id=self.group_id, task_id=task_id, segment=i,
                       tokens=s.tokens, loss_mask=s.loss_mask, logprobs=s.logprobs,
                       versions=s.versions, reward=reward, finish_reason=finish,
                       sampling=self.sampling, images=s.images or None,
                       routed_experts=fit_routing(s.routing, len(s.tokens)),
                       info={**info, "turns": self.turns, "sealed_because": s.sealed_because,
                             "tool_call_errors": self.tool_call_errors,
                             **({"parsed_tool_calls": self.tool_calls} if self.tools else {})})
                for i, s in enumerate(self.segments) if any(s.loss_mask)]
