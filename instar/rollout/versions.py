"""The weight version the engines hold, per policy: the one place the run keeps it.

The loop advances it after each weight sync (`Rollouts.publish`). The router asks it, so an
engine that Ray restarted with the checkpoint's weights is given the current ones before it
generates; admission control (`Stream`) waits on it. Each engine also stamps the version it
holds on every token it generates: that is what the token records, not a second setting.
"""

import asyncio

POLICY = "policy"
"""The policy of a run with one trained model."""


class Versions:
    def __init__(self):
        self.held: dict[str, int] = {}
        self.weights: dict[str, list[str]] = {}
        """Where each policy's current weights are (file transport), to reload a restarted
        engine; empty before the first sync (the engines start from the checkpoint)."""
        self.changed = asyncio.Condition()

    def __getitem__(self, policy: str) -> int:
        return self.held.get(policy, 0)

    async def advance(self, policy: str, version: int, weights: list[str]) -> None:
        """The engines of `policy` now hold `version` (its files: `weights`)."""
        async with self.changed:
            self.held[policy], self.weights[policy] = version, weights
            self.changed.notify_all()
