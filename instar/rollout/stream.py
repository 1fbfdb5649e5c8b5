"""The training stream: groups of rollouts started in a fixed order, admitted only while the
staleness bound allows, and handed to the loop step by step.

    ticket t = the t-th group of the run; step k trains on tickets (k-1)P .. kP-1

    producer:  wait until admitted(next) ──> start group `next` ──> next += 1 ──> ...
    admitted(t):  t // P - versions[policy] <= max_staleness
    take(k):   wait until every ticket of step k is done; hand them over in ticket order

This is the one place the staleness bound is enforced. Ticket t starts only once the engines
hold version >= t // P - max_staleness; step t // P + 1 trains on it with the policy of
version t // P, so no token of it is more than max_staleness versions old (a partial rollout
resumed on newer weights only gets younger tokens). Long episodes are never overtaken and
dropped: a step waits for its own tickets. max_staleness 0: generation and training
alternate; k > 0: the groups of the next k steps are generated while the trainer trains.
"""

import asyncio

from instar.rollout.runner import Batch, Rollouts
from instar.rollout.versions import POLICY


class Stream:
    def __init__(self, rollouts: Rollouts, task_at, per_step: int, group_size: int,
                 sampling: dict, max_staleness: int, first_ticket: int, policy: str = POLICY):
        self.rollouts, self.task_at, self.per_step = rollouts, task_at, per_step
        self.group_size, self.sampling, self.max_staleness = group_size, sampling, max_staleness
        self.versions, self.policy = rollouts.versions, policy
        self.next = first_ticket
        self.done: dict[int, Batch | Exception] = {}
        self.finished = asyncio.Condition()
        self.running: set[asyncio.Future] = set()
        self.producer = rollouts.submit(self._produce())

    def _admitted(self) -> bool:
        return self.next // self.per_step - self.versions[self.policy] <= self.max_staleness

    async def _produce(self) -> None:
        while True:
            async with self.versions.changed:
                await self.versions.changed.wait_for(self._admitted)
            t, self.next = self.next, self.next + 1
            self.running.add(g := asyncio.ensure_future(self._group(t)))
            g.add_done_callback(self.running.discard)

    async def _group(self, t: int) -> None:
        try:
            self.done[t] = await self.rollouts.group(self.task_at(t), self.group_size,
                                                     self.sampling, f"t{t}")
        except Exception as e:  # not an agent's failure (those are counted): stop the run
            self.done[t] = e
        async with self.finished:
            self.finished.notify_all()

    async def _take(self, tickets: range) -> list[Batch]:
        async with self.finished:
            await self.finished.wait_for(lambda: all(t in self.done for t in tickets))
        groups = [self.done.pop(t) for t in tickets]
        for g in groups:
            if isinstance(g, Exception):
                raise g
        return groups

    def take(self, step: int) -> list[Batch]:
        """The groups of `step` (blocks until they are all done), in ticket order."""
        return self.rollouts.submit(self._take(range((step - 1) * self.per_step,
                                                     step * self.per_step))).result()

    def close(self) -> None:
        """Stop admitting tickets; cancel the groups still running and wait until they end."""
        self.producer.cancel()

        async def drain():
            for g in list(self.running):
                g.cancel()
            await asyncio.gather(*self.running, return_exceptions=True)
        self.rollouts.submit(drain()).result()
