"""Run a user's agent (Env or ChatAgent) over tasks on the engines; collect Samples.

A failing or hanging agent costs its rollout only: it is counted by reason, its traceback
kept, and the rest of the batch goes on. What happens to the rollout is the run's failure
policy: drop it, drop its whole group, or retry it with a fresh agent. An episode stopped
by a weight update (see `Engine.load_weights`) or by an engine that died is restarted with
a fresh agent, up to `MAX_RESTARTS` times, and is not an agent failure.

Episodes run as asyncio tasks on one background event loop, so rollouts can go on while
the caller trains (see `Stream`).
"""

import asyncio
import itertools
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field

from instar.agents.contract import ChatAgent, Env, Task
from instar.agents.env_loop import EpisodeError, Requeue, run_env_episode
from instar.agents.judge import Judge
from instar.gateway.episode import run_chat_episode
from instar.gateway.server import Gateway
from instar.rollout.router import Router
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


class Rollouts:
    """Holds the router over the engines, the tokenizer, the event loop the episodes run on,
    and (for ChatAgents) a running gateway."""

    def __init__(self, agent_cls: type[Env] | type[ChatAgent], agent_config: dict,
                 engines: list, tokenizer, *, model_name: str, max_model_len: int, limits: dict,
                 on_failure: str = "drop_rollout", max_retries: int = 0, judge: str = "",
                 judge_engines: list | None = None):
        """`judge`: "" (none), "policy" (a judge on `engines`) or the folder of a frozen
        model served by `judge_engines` (started by the caller, shut down by `close`)."""
        self.agent_cls, self.agent_config, self.tokenizer = agent_cls, agent_config, tokenizer
        self.router = Router(engines)
        self.limits = {k: v for k, v in limits.items() if v is not None}
        self.max_model_len = max_model_len
        self.on_failure, self.max_retries = on_failure, max_retries
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="rollouts").start()
        self.gateway = None
        if issubclass(agent_cls, ChatAgent):
            self.gateway = Gateway(self.router.generate, tokenizer, model=model_name,
                                   max_model_len=max_model_len).start()
        self.judge_engines, self.judge = judge_engines or [], None
        if judge:
            from transformers import AutoTokenizer

            router = Router(self.judge_engines) if self.judge_engines else self.router
            tok = tokenizer if judge == "policy" else AutoTokenizer.from_pretrained(judge)
            self.judge = Judge(lambda ids, s: self._judge_generate(router, ids, s), tok)
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
        agent = self._agent()
        try:
            if self.gateway is None:
                generate = lambda ids, s, im: self.router.generate(rollout_id, ids, s, im)  # noqa: E731
                return [await run_env_episode(agent, task, generate, self.tokenizer, sampling,
                                              rollout_id, group_id)]
            return await run_chat_episode(agent, task, self.gateway, sampling, rollout_id,
                                          group_id)
        finally:
            self.router.release(rollout_id)

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
        batch = Batch()
        ok = await asyncio.gather(*(self._one(task, sampling, f"{tag}-{task.id}-{k}",
                                              f"{tag}-{task.id}", batch) for k in range(n)))
        if self.on_failure == "drop_group" and not all(ok) and batch.samples:
            batch.samples, batch.dropped_groups = [], 1
        return batch

    def submit(self, coro):
        """Run `coro` on the rollout loop; a concurrent.futures.Future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, tasks: list[Task], n: int, sampling: dict, tag: str) -> Batch:
        """`n` episodes of each task (blocks until all are done)."""
        async def all_groups():
            batch = Batch()
            for b in await asyncio.gather(*(self.group(t, n, sampling, tag) for t in tasks)):
                batch.add(b)
            return batch
        return self.submit(all_groups()).result()

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        if self.judge_engines:
            async def stop():
                await asyncio.gather(*(e.shutdown.remote() for e in self.judge_engines))
            self.submit(stop()).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


class Stream:
    """Groups of rollouts for training, started and handed out in order: ticket t is the
    t-th group of the run, and step k trains on tickets (k-1)P .. kP-1 (P groups a step).

    Admission control: ticket t starts only once the engines hold weights of version at
    least t // P - max_staleness, so when step t // P + 1 trains on it (with the policy of
    version t // P) no token of it is more than max_staleness versions old. Long episodes
    are never overtaken and dropped: a step waits for its own tickets. With
    max_staleness = 0 generation and training alternate; with k > 0, the groups of the
    next k steps are generated while the trainer trains and syncs.
    """

    def __init__(self, rollouts: Rollouts, task_at, per_step: int, group_size: int,
                 sampling: dict, max_staleness: int, first_ticket: int, version: int):
        self.rollouts, self.task_at, self.per_step = rollouts, task_at, per_step
        self.group_size, self.sampling, self.max_staleness = group_size, sampling, max_staleness
        self.next, self.version = first_ticket, version
        self.done: dict[int, Batch] = {}
        self.changed = asyncio.Condition()
        self.running: set[asyncio.Future] = set()
        self.producer = rollouts.submit(self._produce())

    def _admitted(self) -> bool:
        return self.next // self.per_step - self.version <= self.max_staleness

    async def _produce(self) -> None:
        while True:
            async with self.changed:
                await self.changed.wait_for(self._admitted)
            t, self.next = self.next, self.next + 1
            self.running.add(g := asyncio.ensure_future(self._group(t)))
            g.add_done_callback(self.running.discard)

    async def _group(self, t: int) -> None:
        try:
            self.done[t] = await self.rollouts.group(self.task_at(t), self.group_size,
                                                     self.sampling, f"t{t}")
        except Exception as e:  # not an agent's failure (those are counted): stop the run
            self.done[t] = e
        async with self.changed:
            self.changed.notify_all()

    async def _take(self, tickets: range) -> list[Batch]:
        async with self.changed:
            await self.changed.wait_for(lambda: all(t in self.done for t in tickets))
        groups = [self.done.pop(t) for t in tickets]
        for g in groups:
            if isinstance(g, Exception):
                raise g
        return groups

    def take(self, step: int) -> list[Batch]:
        """The groups of `step` (blocks until they are all done), in ticket order."""
        return self.rollouts.submit(self._take(range((step - 1) * self.per_step,
                                                     step * self.per_step))).result()

    def set_version(self, version: int) -> None:
        """The engines now hold `version`: admit the tickets it allows."""
        async def notify():
            self.version = version
            async with self.changed:
                self.changed.notify_all()
        self.rollouts.submit(notify()).result()

    def close(self) -> None:
        """Stop admitting tickets; cancel the groups still running and wait until they end."""
        self.producer.cancel()

        async def drain():
            for g in self.running:
                g.cancel()
            await asyncio.gather(*self.running, return_exceptions=True)
        self.rollouts.submit(drain()).result()
