"""Agent runners: episodes in runner processes (Ray actors), each with its own gateway; a
runner that dies costs its groups a restart, not the run."""

import os

import pytest
import ray

from instar import Task
from instar.rollout.runners import Runners

pytestmark = pytest.mark.stack

AGENT = '''
import asyncio, os
import openai
from instar import ChatAgent, Result

class Where(ChatAgent):
    """One model turn, streamed, through the stock SDK; says which process and gateway
    served it and what it read."""
    timeout_s = 60.0

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        chunks = await client.chat.completions.create(model=ctx.model, stream=True, messages=[
            {"role": "user", "content": ctx.task.prompt}])
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        await asyncio.sleep(float(ctx.task.data.get("sleep", 0)))
        return Result(reward=1.0, info={"pid": os.getpid(), "url": ctx.openai_base_url,
                                        "text": text})

AgentRunner = Where
'''


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "where.py"
    path.write_text(AGENT)
    return str(path)


def runners(agent_file, engine, tokenizer, count=2):
    return Runners(count, "", agent_file, {}, [engine], tokenizer, model_name="tiny",
                   max_model_len=512, limits={})


SAMPLING = {"temperature": 1.0, "max_tokens": 4}


def clean(text: str) -> str:
    return text.replace("\ufffd", "").strip()


def test_two_runners_run_the_episodes_each_behind_its_own_loopback_gateway(
        agent_file, engine, tokenizer):
    r = runners(agent_file, engine, tokenizer)
    try:
        batch = r.run([Task(prompt=f"task {i}", id=str(i)) for i in range(6)], 2, SAMPLING, "t")
    finally:
        r.close()
    assert not batch.failed and len(batch.samples) == 12
    pids = {s.info["pid"] for s in batch.samples}
    assert len(pids) == 2 and os.getpid() not in pids  # both runners, not the driver
    urls = {s.info["url"].split("/s/")[0] for s in batch.samples}
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    for s in batch.samples:  # each episode's tokens, as captured by its runner's gateway
        assert any(s.loss_mask) and len(s.logprobs) == len(s.tokens)
        reply = tokenizer.decode([t for t, m in zip(s.tokens, s.loss_mask) if m],
                                 skip_special_tokens=True)  # the stream read all of it:
        assert clean(reply) == clean(s.info["text"])  # (incomplete bytes decode differently)
        assert all(v == 0 for v, m in zip(s.versions, s.loss_mask) if m)
    assert r.gateway is None  # the driver serves no HTTP


def test_a_runner_that_dies_costs_its_groups_a_restart_not_the_run(agent_file, engine, tokenizer):
    r = runners(agent_file, engine, tokenizer)
    try:
        tasks = [Task(prompt=f"task {i}", id=str(i), data={"sleep": 3}) for i in range(4)]
        pending = r.submit(r.group(tasks[0], 2, SAMPLING, "a"))
        others = [r.submit(r.group(t, 2, SAMPLING, "b")) for t in tasks[1:]]
        while not any(r.busy):
            pass
        victim = next(k for k, b in enumerate(r.busy) if b)
        ray.kill(r.actors[victim], no_restart=False)  # mid-episode: Ray restarts it
        batches = [f.result(timeout=120) for f in [pending, *others]]
        assert all(not b.failed and len(b.samples) == 2 for b in batches)
        assert sum(b.restarted for b in batches) >= 2
        again = r.run(tasks[:2], 2, SAMPLING, "c")  # the run goes on, the restarted runner too
        assert not again.failed and len(again.samples) == 4
    finally:
        r.close()
