"""Admission control, the one place the staleness bound is enforced: a group starts only when
the engines' weights are recent enough that no token of it is older than `max_staleness`
versions when its step trains on it. Fast: fake rollouts on the real Stream and Versions."""

import asyncio
import threading
from dataclasses import dataclass

import pytest

from instar.rollout.runner import Batch
from instar.rollout.stream import Stream
from instar.rollout.versions import POLICY, Versions


@dataclass
class Group(Batch):
    ticket: int = -1


class Rollouts:
    """What the Stream uses of `Rollouts`: the versions, the event loop, `group`. Each group
    records the version the engines held when it started, and returns its ticket."""

    def __init__(self):
        self.versions, self.started = Versions(), {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def group(self, task, n, sampling, tag) -> Batch:
        self.started[t := int(tag.removeprefix("t"))] = self.versions[POLICY]
        await asyncio.sleep(0.005)
        return Group(ticket=t)

    def trained(self, step: int) -> None:
        self.submit(self.versions.advance(POLICY, step, [])).result()


def tickets(groups: list) -> list[int]:
    return [g.ticket for g in groups]


def informative(group) -> bool:
    return group.ticket % 3 != 0  # (every third group has equal rewards)


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


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_step_refills_dropped_groups_and_keeps_the_bound(max_staleness):
    P, steps, rollouts = 3, 6, Rollouts()
    stream = Stream(rollouts, lambda t: t, P, 2, {}, max_staleness, first_ticket=0,
                    max_resample=2, keep=informative)
    taken_by, ends = {}, {0: 0}  # ends[k]: the first ticket after step k
    for step in range(1, steps + 1):
        kept = tickets(stream.take(step))
        drawn = range(ends[step - 1], stream.first)  # in order, from where the last step ended
        assert len(kept) == P and kept[-1] == drawn[-1]  # (it stops at the P-th kept)
        assert kept == [t for t in drawn if t % 3] and len(drawn) > P
        assert tickets(stream.dropped) == [t for t in drawn if t % 3 == 0]
        taken_by |= dict.fromkeys(drawn, step)
        ends[step] = stream.first
        rollouts.trained(step)
    stream.close()
    for t, version in rollouts.started.items():
        last = version + max_staleness + 1  # the latest step allowed to train on ticket t
        assert last > steps or t < ends[last], (t, version)
    assert max(taken_by[t] - 1 - v for t, v in rollouts.started.items() if t in taken_by) \
        == max_staleness  # and it does run that far ahead


def test_max_resample_bounds_what_a_step_draws():
    P, R, rollouts = 3, 2, Rollouts()  # (max_staleness 0: the refills go past the admitted)
    stream = Stream(rollouts, lambda t: t, P, 2, {}, 0, first_ticket=0, max_resample=R,
                    keep=lambda group: False)
    for step in (1, 2):
        assert stream.take(step) == []
        assert tickets(stream.dropped) == list(range((step - 1) * (P + R), step * (P + R)))
        rollouts.trained(step)
    stream.close()
    assert all(t // (P + R) == v for t, v in rollouts.started.items())


def test_a_stream_resumed_from_its_ticket_takes_what_the_whole_run_takes():
    def stream_on(rollouts, first_ticket):
        return Stream(rollouts, lambda t: t, 4, 2, {}, 1, first_ticket=first_ticket,
                      max_resample=3, keep=informative)

    whole, rollouts = [], Rollouts()
    stream = stream_on(rollouts, 0)
    for step in range(1, 6):
        whole.append((tickets(stream.take(step)), tickets(stream.dropped)))
        rollouts.trained(step)
        if step == 3:
            saved = stream.first
    stream.close()

    rollouts = Rollouts()
    rollouts.trained(3)  # the checkpoint of step 3 is resumed
    stream, resumed = stream_on(rollouts, saved), []
    for step in (4, 5):
        resumed.append((tickets(stream.take(step)), tickets(stream.dropped)))
        rollouts.trained(step)
    stream.close()
    assert resumed == whole[3:] and min(rollouts.started) == saved
