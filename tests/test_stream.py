"""Admission control, the one place the staleness bound is enforced: a group starts only when
the engines' weights are recent enough that no token of it is older than `max_staleness`
versions when its step trains on it. Fast: fake rollouts on the real Stream and Versions."""

import asyncio
import threading

import pytest

from instar.rollout.runner import Batch
from instar.rollout.stream import Stream
from instar.rollout.versions import POLICY, Versions


class Rollouts:
    """What the Stream uses of `Rollouts`: the versions, the event loop, `group`. Each group
    records the version the engines held when it started."""

    def __init__(self):
        self.versions, self.started = Versions(), {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def group(self, task, n, sampling, tag) -> Batch:
        self.started[int(tag.removeprefix("t"))] = self.versions[POLICY]
        await asyncio.sleep(0.005)
        return Batch()


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_no_group_starts_on_weights_older_than_the_bound(max_staleness):
    P, steps, rollouts = 3, 8, Rollouts()
    stream = Stream(rollouts, lambda t: t, P, 2, {}, max_staleness, first_ticket=0)
    ahead = []
    for step in range(1, steps + 1):
        assert len(stream.take(step)) == P
        ahead.append(max(rollouts.started) // P + 1 - step)  # steps generated ahead of this one
        rollouts.submit(rollouts.versions.advance(POLICY, step, [])).result()  # trained, synced
    stream.close()
    for t, version in rollouts.started.items():
        trained_by = t // P  # step t // P + 1 trains with the policy of version t // P
        assert trained_by - version <= max_staleness, (t, version)
    assert max(ahead) == max_staleness  # and it does run that far ahead


def test_a_resumed_stream_starts_at_its_ticket_and_version():
    rollouts = Rollouts()
    rollouts.submit(rollouts.versions.advance(POLICY, 4, [])).result()
    stream = Stream(rollouts, lambda t: t, 2, 2, {}, 0, first_ticket=8)
    stream.take(5)
    stream.close()
    assert min(rollouts.started) == 8 and all(v == 4 for v in rollouts.started.values())
