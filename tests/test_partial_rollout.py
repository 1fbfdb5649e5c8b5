"""Weight updates in the middle of generation, on real engines: paused requests resume on
the new weights with their tokens stamped by version, split at the exact token; with partial
rollout off, every request in flight is aborted and its episode restarted. (Staleness is
bounded before a request starts, by admission control: tests/test_stream.py.)"""

import threading
import time

import openai
import pytest
import ray
from conftest import restore

from instar import ChatAgent, Result, Task
from instar.rollout.runner import Rollouts
from instar.tasks.reverse import Reverse
from instar.tasks.tiny_model import builtin_model

pytestmark = pytest.mark.stack

LONG = {"temperature": 1.0, "max_tokens": 600, "ignore_eos": True}
LEN = 1024


@pytest.fixture
def partial_engine(engines, tiny_model):
    """The session's second engine (its first serves other tests meanwhile)."""
    yield engines[1]
    restore(engines[1], tiny_model)


@pytest.fixture
def restart_engine(partial_engine):
    """The same engine with partial rollout off."""
    ray.get(partial_engine.__ray_call__.remote(lambda e: setattr(e, "partial", False)))
    return partial_engine


@pytest.fixture(scope="module")
def weights(tiny_model):
    """Two different weight files of the same shapes: A (the engines' start) and B."""
    return (str(tiny_model / "model.safetensors"),
            str(builtin_model("dense", "tiny", 1) / "model.safetensors"))


def prompt(tokenizer):
    return tokenizer.encode("<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n")


def once_generating(engine, requests: int = 1, timeout_s: float = 120.0) -> None:
    """Return as soon as `requests` requests are in flight on `engine`, each with a token out
    (polled: a fixed sleep would let a fast machine finish them before the update comes)."""
    done = lambda e: [e._generated_so_far(r) or 0 for r in e.live]  # noqa: E731
    deadline = time.time() + timeout_s
    while len(counts := ray.get(engine.__ray_call__.remote(done))) < requests or min(counts) < 1:
        assert time.time() < deadline, f"requests never started generating: {counts}"
        time.sleep(0.005)
    assert max(counts) < LONG["max_tokens"] // 2, f"polled too late to update mid-request: {counts}"


def update_during(engine, request, path: str, version: int):
    """Start `request` (a Ray ref factory), load weights once it generates, return its result."""
    ref = request()
    once_generating(engine)
    ray.get(engine.load_weights.remote([path], version))
    return ray.get(ref)


def test_paused_request_resumes_on_new_weights_split_at_the_exact_token(
        partial_engine, tokenizer, weights):
    a, b = weights
    ids = prompt(tokenizer)
    gen = update_during(partial_engine, lambda: partial_engine.generate.remote(ids, LONG), b, 1)
    assert gen.finish_reason == "length" and len(gen.token_ids) == LONG["max_tokens"]
    k = gen.versions.index(1)
    assert 0 < k and gen.versions == [0] * k + [1] * (len(gen.token_ids) - k)

    # Score the whole sequence under B (loaded now), then under A: the tokens before the
    # split are A's log-probs, the ones after it B's, to float precision.
    full = ids + gen.token_ids
    under_b = ray.get(partial_engine.prompt_logprobs.remote(full))[len(ids):]
    ray.get(partial_engine.load_weights.remote([a], 2))
    under_a = ray.get(partial_engine.prompt_logprobs.remote(full))[len(ids):]
    diff = lambda ref, span: max(abs(gen.logprobs[i] - ref[i]) for i in span)  # noqa: E731
    assert diff(under_a, range(k)) < 1e-4
    assert diff(under_b, range(k, len(full) - len(ids))) < 1e-4
    # the boundary token itself tells the two weight sets apart
    assert abs(gen.logprobs[k - 1] - under_b[k - 1]) + abs(gen.logprobs[k] - under_a[k]) > 1e-3


class LongChat(ChatAgent):
    """Talks to the model through the OpenAI SDK; its request runs across a weight update."""

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        await client.chat.completions.create(model=ctx.model, messages=[
            {"role": "user", "content": ctx.task.prompt}])
        return Result(reward=1.0)


@pytest.mark.parametrize("agent_cls", [Reverse, LongChat])
def test_without_partial_rollout_episodes_in_flight_restart_on_the_new_weights(
        restart_engine, tokenizer, weights, agent_cls):
    a, _ = weights
    rollouts = Rollouts(agent_cls, {}, [restart_engine], tokenizer, model_name="tiny",
                        max_model_len=LEN, limits={"timeout_s": 120.0})
    tasks = [Task(prompt="Reverse: abc", label="cba", id=str(i)) for i in range(2)]
    out = {}
    worker = threading.Thread(target=lambda: out.update(
        batch=rollouts.run(tasks, 2, LONG, "t")))
    try:
        worker.start()
        once_generating(restart_engine, requests=4)
        ray.get(restart_engine.load_weights.remote([a], 7))
        worker.join()
    finally:
        rollouts.close()
    batch = out["batch"]
    assert not batch.failed and batch.restarted == 4 and len(batch.samples) == 4
    for s in batch.samples:  # every kept token is from the new weights
        assert {v for v in s.versions if v is not None} == {7}
