"""Run a user's agent (Env or ChatAgent) over tasks on the engines; collect Samples.

A failing or hanging agent costs its rollout only: it is counted by reason, its traceback
kept, and the rest of the batch goes on. What happens to the rollout is the run's failure
policy: drop it, drop its whole group, or retry it with a fresh agent. An episode stopped
by a weight update (see `Engine.load_weights`) or by an engine that died is restarted with
a fresh agent, up to `MAX_RESTARTS` times, and is not an agent failure.

Episodes run as asyncio tasks on one background event loop, so rollouts can go on while
the caller trains (see instar/rollout/stream.py); each episode's agent code runs on a thread
and event loop of its own (`AgentThread`), so a blocked agent holds up no other episode.
"""

import asyncio
import itertools
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from instar.agents.contract import ChatAgent, Env, Task
from instar.agents.env_loop import run_env_episode
from instar.agents.judge import Judge
from instar.errors import EpisodeError, Requeue
from instar.gateway.episode import run_chat_episode
from instar.gateway.server import Gateway
from instar.rollout.engine import stop_engines
from instar.rollout.router import Router
from instar.rollout.versions import POLICY, Reload, Versions
from instar.sample import Sample


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)
    failed: Counter = field(default_factory=Counter)
    """Failed rollouts by reason (agent_error, timeout, max_tokens, ...)."""
    errors: list[dict] = field(default_factory=list)
    """One record per failed attempt: rollout_id, reason, traceback."""
    restarted: int = 0
    """Episodes started again after a weight update or an engine's death stopped them."""
    retried: int = 0
    """Failed rollouts tried again with a fresh agent (--rollout.on-failure retry)."""
    dropped_groups: int = 0
    """Groups dropped because one of their rollouts failed (--rollout.on-failure drop_group)."""

    def add(self, other: "Batch") -> "Batch":
        self.samples += other.samples
        self.failed.update(other.failed)
        self.errors += other.errors
        self.restarted += other.restarted
        self.retried += other.retried
        self.dropped_groups += other.dropped_groups
        return self


MAX_RESTARTS = 3
EPISODES_PER_ENGINE = 256
"""Episodes running at once per engine (each has a thread and an event loop of its own: see
AgentThread); `run` over a large dataset queues the others."""


def start_loop() -> asyncio.AbstractEventLoop:
    """The event loop the episodes run on, running in a thread of its own."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="rollouts").start()
    return loop


class Rollouts:
    """Holds the router over the engines, the weight versions they hold, the tokenizer, the
    event loop the episodes run on, and (for ChatAgents) a running gateway."""

    def __init__(self, agent_cls: type[Env] | type[ChatAgent], agent_config: dict,
                 engines: list, tokenizer, *, model_name: str, max_model_len: int, limits: dict,
                 on_failure: str = "drop_rollout", max_retries: int = 0, judge: str = "",
                 judge_engines: list | None = None, hang_s: float = 120.0,
                 max_request_mb: float = 32, seed: int = 0, policy: str = POLICY):
        """`judge`: "" (none), "policy" (a judge on `engines`) or the folder of a frozen
        model served by `judge_engines` (started by the caller, shut down by `close`);
        `hang_s`: see `Router`; `max_request_mb`: the gateway's body limit; `seed`: the run's,
        from which each request's sampling seed derives (see `request_seed`); `policy`: the
        weights the episodes are generated with (multi-LoRA: an adapter's name)."""
        self.agent_cls, self.agent_config, self.tokenizer = agent_cls, agent_config, tokenizer
        self.versions = Versions()
        self.router = Router(engines, self.versions, policy, hang_s=hang_s, seed=seed)
        self.slots = asyncio.Semaphore(EPISODES_PER_ENGINE * len(engines))
        self.limits = {k: v for k, v in limits.items() if v is not None}
        self.max_model_len = max_model_len
        self.on_failure, self.max_retries = on_failure, max_retries
        self.loop = start_loop()
        self.gateway = None
        if issubclass(agent_cls, ChatAgent):
            on_router = lambda *args: asyncio.wrap_future(  # noqa: E731
                self.submit(self.router.generate(*args)))  # (this loop is the router's)
            self.gateway = Gateway(on_router, tokenizer, model=model_name, stream=on_router,
                                   max_model_len=max_model_len, max_body_mb=max_request_mb).start()
        self.judge_engines, self.judge, self.judge_router = judge_engines or [], None, None
        if judge:
            from transformers import AutoTokenizer

            router = self.judge_router = Router(self.judge_engines, Versions(), hang_s=hang_s,
                                                seed=seed) \
                if self.judge_engines else self.router  # (a frozen judge's weights never change)
            tok = tokenizer if judge == "policy" else AutoTokenizer.from_pretrained(judge)
            # asked on an agent's own loop (see AgentThread), answered on this one (the router's)
            self.judge = Judge(lambda ids, s: asyncio.wrap_future(
                self.submit(self._judge_generate(router, ids, s))), tok)
        self.judge_requests = itertools.count()

    async def _judge_generate(self, router: Router, ids: list[int], sampling: dict):
        """One judge request; never part of an episode, so never a training token."""
        for _ in range(MAX_RESTARTS + 1):
            key = f"judge-{next(self.judge_requests)}"
            try:
                return await router.generate(key, ids, sampling)
            except Requeue:  # a weight update or an engine restart stopped it: ask again
                pass
            finally:
                router.release(key)
        raise RuntimeError(f"a judge request was stopped {MAX_RESTARTS + 1} times")

    def _agent(self):
        agent = self.agent_cls(**self.agent_config)
        agent.judge = self.judge
        for name, value in self.limits.items():  # run-config overrides of class limits
            setattr(agent, name, value)
        agent.max_tokens = min(agent.max_tokens, self.max_model_len)  # what the engine takes
        return agent

    async def _episode(self, task: Task, sampling: dict, rollout_id: str,
                       group_id: str) -> list[Sample]:
        await self.slots.acquire()
        try:
            agent = self._agent()
            if self.gateway is None:
                generate = lambda ids, s, im: self.router.generate(rollout_id, ids, s, im)  # noqa: E731
                return [await run_env_episode(agent, task, generate, self.tokenizer, sampling,
                                              rollout_id, group_id)]
            return await run_chat_episode(agent, task, self.gateway, sampling, rollout_id,
                                          group_id)
        finally:
            self.router.release(rollout_id)
            self.slots.release()

    async def _one(self, task: Task, sampling: dict, rollout_id: str, group_id: str,
                   batch: Batch) -> bool:
        """One rollout into `batch`, restarted and retried as the policy says; False if failed."""
        attempts = 1 + (self.max_retries if self.on_failure == "retry" else 0)
        for attempt in range(attempts):
            try:
                for _ in range(MAX_RESTARTS + 1):
                    try:
                        batch.samples += await self._episode(task, sampling, rollout_id, group_id)
                        return True
                    except Requeue:
                        batch.restarted += 1
                raise EpisodeError("restarts", f"stopped {MAX_RESTARTS + 1} times by weight "
                                   "updates or engine failures")
            except EpisodeError as e:
                batch.errors.append({"rollout_id": rollout_id, "reason": e.reason,
                                     "attempt": attempt,
                                     "traceback": "".join(traceback.format_exception(e))})
                if attempt + 1 == attempts:
                    batch.failed[e.reason] += 1
                else:
                    batch.retried += 1
        return False

    async def group(self, task: Task, n: int, sampling: dict, tag: str) -> Batch:
        """`n` rollouts of one task, sharing a group id."""
        batch, ids = Batch(), [f"{tag}-{task.id}-{k}" for k in range(n)]
        ok = await asyncio.gather(*(self._one(task, sampling, i, f"{tag}-{task.id}", batch)
                                    for i in ids))
        # in sample order, whichever ended first: the update's mini-batches go by it (exact resume)
        batch.samples.sort(key=lambda s: (ids.index(s.rollout_id), s.segment))
        if self.on_failure == "drop_group" and not all(ok) and batch.samples:
            batch.samples, batch.dropped_groups = [], 1
        return batch

    def submit(self, coro):
        """Run `coro` on the rollout loop; a concurrent.futures.Future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def publish(self, version: int, reload: Reload | None, policy: str = POLICY) -> None:
        """The engines now hold `version` of `policy` (an engine that restarts gets it through
        `reload`, see instar/weight_sync.py): the router and admission control go by it from
        now on."""
        self.submit(self.versions.advance(policy, version, reload)).result()

    def run(self, tasks: list[Task], n: int, sampling: dict, tag: str,
            done: Callable[[int], None] = lambda n: None) -> Batch:
        """`n` episodes of each task (blocks until all are done); `done(n)` as each task's
        episodes end (on the rollout loop's thread)."""
        async def group(t: Task) -> Batch:
            b = await self.group(t, n, sampling, tag)
            done(n)
            return b

        async def all_groups():
            batch = Batch()
            for b in await asyncio.gather(*(group(t) for t in tasks)):
                batch.add(b)
            return batch
        return self.submit(all_groups()).result()

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        if self.judge_engines:
            stop_engines(self.judge_engines)
        for router in {self.router, self.judge_router} - {None}:
            self.submit(router.close()).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
