"""Hung engines are found and replaced; a cancelled request stops its engine's generation.

The watchdog's judgement on scripted engines (no Ray), then a real engine made to hang: the
router's watchdog kills it, Ray restarts it, and the episodes it held are restarted and end."""

import asyncio
import itertools

import pytest
import ray
from conftest import restore

from instar.errors import Requeue
from instar.rollout.router import Router
from instar.rollout.versions import Versions


class Scripted:
    """An engine whose `progress.remote()` answers what `state` says (None: never answers)."""

    def __init__(self, state):
        self.state, self.progress = state, self

    async def remote(self):
        answer = self.state()
        if answer is None:
            await asyncio.Event().wait()
        return answer


def test_the_watchdog_replaces_only_engines_with_work_and_no_progress():
    count = itertools.count()
    engines = [Scripted(lambda: (0, 7, False)),              # idle
               Scripted(lambda: (3, 7, True)),               # loading weights
               Scripted(lambda: (3, next(count), False)),    # generating
               Scripted(lambda: (3, 7, False)),              # requests, no token: hung
               Scripted(lambda: None)]                       # does not answer: hung
    router, replaced = Router(engines, Versions(), hang_s=0.2), set()
    router.replace = replaced.add

    async def watch_a_while():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(router.watch(), 2)
    asyncio.run(watch_a_while())
    assert replaced == {3, 4}


@pytest.mark.stack
def test_a_hung_engine_is_replaced_and_its_episodes_end(engines, tokenizer, tiny_model):
    def hang(engine):  # every request now waits forever, the engine's process alive
        async def never(*args, **kwargs):
            await asyncio.Event().wait()
            yield
        engine.llm.generate = never
    ray.get(engines[1].__ray_call__.remote(hang))
    router = Router(engines, Versions(), hang_s=4)
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    async def episode(k):
        try:
            for _ in range(4):
                try:
                    return await router.generate(f"ep{k}", ids, {"temperature": 1.0,
                                                                 "max_tokens": 4})
                except Requeue:  # what `Rollouts` does: the episode starts again
                    pass
        finally:
            router.release(f"ep{k}")

    async def run():
        return await asyncio.gather(*(episode(k) for k in range(4)))
    try:
        gens = asyncio.run(run())
        assert sorted(g.engine for g in gens) == [0, 0, 1, 1]
        assert all(g.token_ids for g in gens)
        assert [ray.get(e.stats.remote())["restarted"] for e in engines] == [0, 1]
    finally:
        for e in engines:
            restore(e, tiny_model)


@pytest.mark.stack
def test_a_cancelled_request_stops_generating(engine, tokenizer):
    router = Router([engine], Versions(), hang_s=0)
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    async def cancel_once_generating():
        _, before, _ = await engine.progress.remote()
        task = asyncio.ensure_future(router.generate("c", ids, {
            "temperature": 1.0, "max_tokens": 1000 - len(ids), "ignore_eos": True}))
        while (await engine.progress.remote())[1] == before:
            await asyncio.sleep(0.05)
        task.cancel()
        while (await engine.progress.remote())[0]:  # the request leaves the engine
            await asyncio.sleep(0.05)
        return before, (await engine.progress.remote())[1]
    before, after = asyncio.run(cancel_once_generating())
    assert after == before  # aborted: it never finished its 1000 tokens
