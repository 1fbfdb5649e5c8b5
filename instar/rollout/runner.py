"""Run a user's agent (Env or ChatAgent) over tasks on an engine; collect Samples.

A failing or hanging agent costs its rollout only: it is counted by reason, and its
traceback kept, and the rest of the batch goes on. An episode stopped by a weight update
(see `Engine.load_weights`) is restarted with a fresh agent, up to `MAX_RESTARTS` times.
"""

import asyncio
import traceback
from collections import Counter
from dataclasses import dataclass, field

from instar.agents.contract import ChatAgent, Env, Task
from instar.agents.env_loop import EpisodeError, Requeue, run_env_episode
from instar.gateway.episode import run_chat_episode
from instar.gateway.server import Gateway
from instar.rollout.router import Router
from instar.sample import Sample


@dataclass
class Batch:
    samples: list[Sample]
    failed: Counter = field(default_factory=Counter)
    """Failed rollouts by reason (agent_error, timeout, max_tokens, ...)."""
    errors: list[dict] = field(default_factory=list)
    """One record per failed rollout: rollout_id, reason, traceback."""
    restarted: int = 0
    """Episodes started again after a weight update stopped them."""


MAX_RESTARTS = 3


class Rollouts:
    """Holds the engine handle, the tokenizer and (for ChatAgents) a running gateway."""

    def __init__(self, agent_cls: type[Env] | type[ChatAgent], agent_config: dict,
                 engines: list, tokenizer, *, model_name: str, max_model_len: int, limits: dict):
        self.agent_cls, self.agent_config, self.tokenizer = agent_cls, agent_config, tokenizer
        self.router = Router(engines)
        self.limits = {k: v for k, v in limits.items() if v is not None}
        self.max_model_len = max_model_len
        self.gateway = None
        if issubclass(agent_cls, ChatAgent):
            self.gateway = Gateway(self.router.generate, tokenizer, model=model_name,
                                   max_model_len=max_model_len).start()

    def _agent(self):
        agent = self.agent_cls(**self.agent_config)
        for name, value in self.limits.items():  # run-config overrides of class limits
            setattr(agent, name, value)
        agent.max_tokens = min(agent.max_tokens, self.max_model_len)  # what the engine takes
        return agent

    async def _episode(self, task: Task, sampling: dict, rollout_id: str,
                       group_id: str) -> list[Sample]:
        agent = self._agent()
        try:
            if self.gateway is None:
                generate = lambda ids, s: self.router.generate(rollout_id, ids, s)  # noqa: E731
                return [await run_env_episode(agent, task, generate, self.tokenizer, sampling,
                                              rollout_id, group_id)]
            return await run_chat_episode(agent, task, self.gateway, sampling, rollout_id,
                                          group_id)
        finally:
            self.router.release(rollout_id)

    async def _one(self, task: Task, sampling: dict, rollout_id: str, group_id: str,
                   batch: Batch) -> None:
        try:
            for _ in range(MAX_RESTARTS + 1):
                try:
                    batch.samples += await self._episode(task, sampling, rollout_id, group_id)
                    return
                except Requeue:
                    batch.restarted += 1
            raise EpisodeError("restarts", f"stopped by weight updates {MAX_RESTARTS + 1} times")
        except EpisodeError as e:
            batch.failed[e.reason] += 1
            batch.errors.append({"rollout_id": rollout_id, "reason": e.reason,
                                 "traceback": "".join(traceback.format_exception(e))})

    def run(self, tasks: list[Task], n: int, sampling: dict, tag: str) -> Batch:
        """`n` episodes of each task; rollouts of one task share a group id."""
        batch = Batch([])

        async def all_episodes():
            await asyncio.gather(*(self._one(t, sampling, f"{tag}-{t.id}-{k}", f"{tag}-{t.id}",
                                             batch) for t in tasks for k in range(n)))
        asyncio.run(all_episodes())
        return batch

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
