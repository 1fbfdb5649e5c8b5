"""The training stream: groups of rollouts started in a fixed order, admitted only while the
staleness bound allows, and handed to the loop step by step.

    ticket t = the t-th group of the run (task task_at(t)); first = the next one to take

    producer:  wait until admitted(next) ──> start group `next` ──> next += 1 ──> ...
    admitted(t):  t < start[v] + (max_staleness + 1) P     (v = versions[policy])
    take(k):   for t = first, first + 1, ...: wait for group t (start it if not yet started),
               keep it if keep(group); stop at P kept or P + max_resample drawn;
               start[k] = first, the first ticket of step k + 1

This is the one place the staleness bound is enforced. Every step draws at least P tickets,
so a ticket admitted while the engines hold version v is taken by step v + max_staleness + 1
at the latest, which trains with version v + max_staleness: no token of it is more than
max_staleness versions old (a partial rollout resumed on newer weights only gets younger
tokens). A refill that take(k) starts itself runs on version k - 1 and step k trains on it.
Keeping every group, step k draws exactly tickets (k-1)P .. kP-1. Long episodes are never
overtaken and dropped: a step waits for its tickets in order. max_staleness 0: generation
and training alternate; S > 0: the groups of the next S steps are generated while the
trainer trains. Resume: a Stream from the saved `first` draws the same tickets again.
"""

import asyncio
from collections.abc import Callable

from instar.rollout.runner import Batch, Rollouts
from instar.rollout.versions import POLICY


class Stream:
    def __init__(self, rollouts: Rollouts, task_at, per_step: int, group_size: int,
                 sampling: dict, max_staleness: int, first_ticket: int, policy: str = POLICY,
                 max_resample: int = 0, keep: Callable[[Batch], bool] = lambda group: True):
        """`first_ticket`: the first ticket of the step after the engines' version (0, or on
        resume the `first` saved in the checkpoint); `keep(group)`: whether a step trains on a
        finished group (called on the rollout thread: keep it quick); a step draws at most
        `max_resample` groups beyond `per_step` to replace those it does not keep."""
        self.rollouts, self.task_at, self.per_step = rollouts, task_at, per_step
        self.group_size, self.sampling, self.max_staleness = group_size, sampling, max_staleness
        self.max_resample, self.keep = max_resample, keep
        self.versions, self.policy = rollouts.versions, policy
        self.next = self.first = first_ticket
        """next: the next ticket to start; first: the next one to take (what a resume needs)."""
        self.start = {self.versions[policy]: first_ticket}
        """start[v]: the first ticket of step v + 1."""
        self.dropped: list[Batch] = []
        """The groups the last `take` drew and did not keep, in ticket order."""
        self.started: dict[int, asyncio.Future[Batch]] = {}
        self.producer = rollouts.submit(self._produce())

    def _admitted(self) -> bool:
        v = self.versions[self.policy]
        return self.next < self.start[v] + (self.max_staleness + 1) * self.per_step

    async def _produce(self) -> None:
        while True:
            async with self.versions.changed:
                await self.versions.changed.wait_for(self._admitted)
            self._start()

    def _start(self) -> None:
        t, self.next = self.next, self.next + 1
        self.started[t] = asyncio.ensure_future(self.rollouts.group(
            self.task_at(t), self.group_size, self.sampling, f"t{t}"))

    async def _take(self, step: int) -> list[Batch]:
        assert self.versions[self.policy] == step - 1, "take(k) runs on the weights of step k-1"
        kept, self.dropped = [], []
        end = self.first + self.per_step + self.max_resample
        while len(kept) < self.per_step and self.first < end:
            if self.first == self.next:  # a refill past the admitted tickets: start it now
                self._start()
            # (agents' failures are counted in the group; anything it raises stops the run)
            group = await self.started.pop(self.first)
            self.first += 1
            (kept if self.keep(group) else self.dropped).append(group)
        self.start[step] = self.first
        return kept

    def take(self, step: int) -> list[Batch]:
        """The groups `step` keeps, in ticket order (blocks until they are done); the ones it
        drew and dropped are in `dropped`, and `first` is where step + 1 begins."""
        return self.rollouts.submit(self._take(step)).result()

    def close(self) -> None:
        """Stop admitting tickets; cancel the groups started and not taken; wait until they end."""
        self.producer.cancel()

        async def drain():
            for g in self.started.values():
                g.cancel()
            await asyncio.gather(*self.started.values(), return_exceptions=True)
        self.rollouts.submit(drain()).result()
