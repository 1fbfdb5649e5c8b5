"""Shared fixtures: the built-in tiny model, one Ray session and one engine for all tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_model():
    from instar.tasks.tiny_model import builtin_model

    return builtin_model("dense", "tiny", 0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def engine(ray_session, tiny_model):
    import ray

    from instar.rollout.engine import Engine

    actor = ray.remote(num_cpus=0)(Engine).remote(
        str(tiny_model), dtype="float32", max_model_len=512, kv_cache_gb=1, threads=1, seed=0)
    yield actor
    ray.get(actor.shutdown.remote())
