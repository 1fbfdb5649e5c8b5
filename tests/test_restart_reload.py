"""An engine Ray restarted gets the current weights under every transport (no GPU, no Ray).

The router gives it the `reload` published with the current version; a GPU transport's
reload is a send from the trainer, possible only while the trainer's ranks still hold that
version: once they have stepped, the engine waits for the next sync. The trainer's side is
checked with scripted ranks: which version may be sent again, which engine is linked anew,
and that the calls of two threads reach every rank in one order (they are collectives).
(Real engines restarted over the file transport: tests/test_async_loop.py.)"""

import asyncio
import sys
import threading
import time

import pytest
import ray

from instar.config import Config
from instar.errors import Requeue
from instar.rollout.engine import Generation
from instar.rollout.router import Router
from instar.rollout.versions import POLICY, Versions
from instar.train.batch import Sequence
from instar.train.trainer import Trainer


class Call:
    """`engine.method.remote(*args)`: awaitable, answered by `answer(*args)`."""

    def __init__(self, answer):
        self.answer = answer

    async def remote(self, *args):
        return self.answer(*args)


class Restarted:
    """An engine that Ray has just restarted: it holds version 0 until reloaded."""

    def __init__(self):
        self.version = 0
        self.__ray_ready__ = Call(lambda: True)
        self.generate = Call(lambda ids, sampling, current, images, policy: Generation(
            [], [], [], "behind" if self.version < current else "stop", ""))


def test_a_restarted_engine_is_reloaded_once_however_many_episodes_notice():
    engine, calls = Restarted(), []
    versions = Versions()
    router = Router([engine], versions, hang_s=0)

    async def reload(i):
        calls.append(i)
        await asyncio.sleep(0.05)
        engine.version = 3
        return True

    async def run():
        await versions.advance(POLICY, 3, reload)
        return await asyncio.gather(*(router.generate(f"ep{k}", [1], {}) for k in range(4)),
                                    return_exceptions=True)
    first, *later = asyncio.run(run())
    assert isinstance(first, Requeue)  # it met the engine behind and restarts its episode;
    assert [g.finish_reason for g in later] == ["stop"] * 3  # the others waited for the reload
    assert calls == [0] and not router.recovering


def test_when_the_version_cannot_be_had_the_engine_waits_for_the_next_sync():
    engine, versions = Restarted(), Versions()
    router = Router([engine], versions, hang_s=0)

    async def too_late(i):  # the trainer stepped after publishing version 3
        return False

    async def run():
        await versions.advance(POLICY, 3, too_late)
        recovering = asyncio.ensure_future(router._recover(0))
        await asyncio.sleep(0.1)
        assert not recovering.done()  # no weights to give: it waits ...
        engine.version = 4  # ... for sync 4, which links and sends to every restarted engine
        await versions.advance(POLICY, 4, too_late)
        await asyncio.wait_for(recovering, 1)
        return await router.generate("ep", [1], {})
    assert asyncio.run(run()).finish_reason == "stop"


class Rank:
    """A scripted trainer rank: records the calls it gets, in order."""

    def __init__(self):
        self.log = []
        for method in ("train_step", "link", "send_weights", "score"):
            setattr(self, method, self._recorder(method))

    def _recorder(self, method):
        class Method:
            def remote(_, *args):
                time.sleep(0)  # (a thread switch may come here, as in a real submission)
                self.log.append((method, *args[-1:]) if method != "train_step" else (method,))
                return {"loss": 0.0, "grad_norm": 0.0}
        return Method()


@pytest.fixture
def trainer(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)
    t = Trainer.__new__(Trainer)  # its ranks scripted, no Ray
    t.workers, t.cfg, t.lock, t.linked, t.sent = [Rank(), Rank()], Config(), threading.Lock(), {}, 0
    t.active = ""  # (no LoRA adapter chosen)
    return t


def test_the_trainer_resends_only_the_version_its_ranks_still_hold(trainer):
    seqs = [Sequence([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [0.0, 1.0, 1.0])]
    trainer.link(["a0", "b0"])
    trainer.step(seqs, "pg", 1e-3)
    trainer.send_weights(1)
    assert trainer.resend(1, "b1", 0) is None  # an older version: gone
    assert len(trainer.resend(1, "b1", 1)) == 4  # engine 1 restarted: linked anew, then sent
    assert len(trainer.resend(1, "b1", 1)) == 2  # the same incarnation: sent only
    trainer.step(seqs, "pg", 1e-3)
    assert trainer.resend(1, "b1", 1) is None  # the ranks have moved on: the next sync
    trainer.link(["a0", "b2"])  # the sync finds engine 1 restarted again
    for rank in trainer.workers:
        assert rank.log == [("link", 0), ("link", 1), ("train_step",), ("send_weights",),
                            ("link", 1), ("send_weights", 1), ("send_weights", 1),
                            ("train_step",), ("link", 1)]


def test_the_calls_of_two_threads_reach_every_rank_in_one_order(trainer):
    trainer.send_weights(1)

    def loop():
        for _ in range(1000):
            trainer._submit("score", 1.0, parts=[[], []])

    def router():
        for k in range(1000):
            trainer.resend(0, f"a{k}", 1)
    threads = [threading.Thread(target=loop), threading.Thread(target=router)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns often
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    first, second = (rank.log for rank in trainer.workers)
    assert len(first) == 1 + 1000 + 2000 and first == second
