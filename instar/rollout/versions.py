"""The weight version the engines hold, per policy: the one place the run keeps it.

The loop advances it after each weight sync (`Rollouts.publish`). The router asks it, so an
engine that Ray restarted with the checkpoint's weights is given the current ones before it
generates; admission control (`Stream`) waits on it. Each engine also stamps the version it
holds on every token it generates: that is what the token records, not a second setting.
"""

import asyncio
from collections.abc import Awaitable, Callable

POLICY = "policy"
"""The policy of a run with one trained model."""

Reload = Callable[[int], Awaitable[bool]]
"""`reload(i)` gives engine i, restarted by Ray, the weights of the version it was published
with; False if that version can no longer be had (see instar/weight_sync.py)."""


class Versions:
    def __init__(self):
        self.held: dict[str, int] = {}
        self.reload: dict[str, Reload | None] = {}
        """How a restarted engine gets each policy's current weights; empty before the first
        sync (the engines start from the checkpoint)."""
        self.changed = asyncio.Condition()

    def __getitem__(self, policy: str) -> int:
        return self.held.get(policy, 0)

    async def advance(self, policy: str, version: int, reload: Reload | None) -> None:
        """The engines of `policy` now hold `version` (a restarted engine gets it: `reload`)."""
        async with self.changed:
            self.held[policy], self.reload[policy] = version, reload
            self.changed.notify_all()
