"""Two real engines behind the router (the session's pair): session affinity, balance,
versions after a sync."""

import asyncio

import pytest
import ray
from conftest import restore

from instar.rollout.router import Router
from instar.rollout.versions import Versions

pytestmark = pytest.mark.stack


@pytest.fixture
def two_engines(engines, tiny_model):
    yield engines
    for e in engines:
        restore(e, tiny_model)


def test_episodes_stay_on_one_engine_and_spread_by_load(two_engines, tokenizer):
    router = Router(two_engines, Versions())
    sampling = {"temperature": 1.0, "max_tokens": 4}
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    async def episode(k):
        served = []
        context = list(ids)
        for _ in range(3):
            gen = await router.generate(f"ep{k}", context, sampling)
            served.append(gen.engine)
            context += gen.token_ids
        return served

    async def all_episodes():
        return await asyncio.gather(*(episode(k) for k in range(8)))

    served = asyncio.run(all_episodes())
    assert all(len(set(s)) == 1 for s in served)  # every turn of an episode: one engine
    assert sorted(s[0] for s in served) == [0] * 4 + [1] * 4  # balanced
    for k in range(8):
        router.release(f"ep{k}")
    assert router.live == [0, 0] and not router.assigned


def test_every_engine_stamps_the_synced_version(two_engines, tokenizer, tiny_model):
    ray.get([e.load_weights.remote([str(tiny_model / "model.safetensors")], 5)
             for e in two_engines])
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    gens = ray.get([e.generate.remote(ids, {"temperature": 1.0, "max_tokens": 3})
                    for e in two_engines])
    assert [(g.engine, set(g.versions)) for g in gens] == [(0, {5}), (1, {5})]
