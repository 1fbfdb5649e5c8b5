"""Each episode's agent code runs on a thread and event loop of its own (`AgentThread`,
instar/agents/env_loop.py): an agent that blocks its thread or ignores cancellation still
ends at `timeout_s`, is counted, and holds up no other episode. No engine: a fake one
answers at once, on the rollout loop, where engine calls must stay.

The checks are orderings, not timings: the other episodes finish, and the stuck one times
out, while the stuck one is still stuck (it stays stuck for HANG_S, far past its timeout).
"""

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import openai
import pytest

from instar import ChatAgent, Env, Result, Task, parse_score
from instar.agents import env_loop
from instar.errors import Requeue
from instar.rollout.runner import MAX_RESTARTS, Rollouts

HANG_S = 10.0
"""How long a stuck agent stays stuck: far past its timeout (and a hang guard)."""
SAMPLING = {"temperature": 1.0, "max_tokens": 4}


class FakeEngine:
    """Stands in for a Ray engine actor: `generate.remote(...)` is awaitable."""

    def __init__(self, tokenizer, text="Score: 7", fail=None):
        self.text, self.fail = text, fail
        self.ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, ids, sampling, version, images=(), policy="policy"):
        # the Router and Ray futures live on the rollout loop (the gateway's calls hop to it)
        assert threading.current_thread().name == "rollouts"
        if self.fail:
            raise self.fail
        return SimpleNamespace(token_ids=self.ids, logprobs=[-1.0] * len(self.ids),
                               versions=[0] * len(self.ids), finish_reason="stop",
                               text=self.text, stop=None, engine=0, routed_experts=None,
                               prompt_ids=None, reasoning=None, content=self.text, tool_calls=[],
                               tool_call_errors=0)


def rollouts(agent_cls, tokenizer, tasks, tag, n=1, judge="", **engine):
    runner = Rollouts(agent_cls, {}, [FakeEngine(tokenizer, **engine)], tokenizer,
                      model_name="tiny", max_model_len=512, limits={}, judge=judge)
    try:
        return runner.run(tasks, n, SAMPLING, tag), runner
    finally:
        runner.close()


def agent_threads(tag: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"agent {tag}-")]


def all_ended(tag: str) -> bool:
    """Whether the agent threads of the episodes tagged `tag` have all ended (they end just
    after their episode: wait for that, up to a hang guard)."""
    deadline = time.monotonic() + 30
    while agent_threads(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not agent_threads(tag)


# -- agents: task "stuck" gets stuck its own way; the others finish only once it is stuck ----
class Gates:
    """One test's events (threads of an earlier test's stuck agent may still run)."""

    def __init__(self):
        self.stuck, self.unstuck, self.release = (threading.Event() for _ in range(3))

    def sleep(self):
        time.sleep(HANG_S)

    def busy(self):
        start = time.monotonic()
        while time.monotonic() - start < HANG_S and not self.release.is_set():
            pass

    async def ignores_cancellation(self):
        start = time.monotonic()
        while time.monotonic() - start < HANG_S and not self.release.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                pass

    async def get_stuck(self, how: str) -> None:
        self.stuck.set()
        if how == "ignores_cancellation":
            await self.ignores_cancellation()
        else:
            getattr(self, how)()
        self.unstuck.set()

    async def until_one_is_stuck(self) -> dict:
        while not self.stuck.is_set():
            await asyncio.sleep(0.01)
        return {"while_stuck": not self.unstuck.is_set()}


class Stuck(Env):
    timeout_s = 1.0

    async def reset(self, task):
        self.task = task
        return task.prompt

    async def step(self, action):
        gates = self.task.data["gates"]
        if self.task.id == "stuck":
            await gates.get_stuck(self.task.data["how"])
        return Result(reward=1.0, info=await gates.until_one_is_stuck())


class StuckChat(ChatAgent):
    timeout_s = 3.0  # (HTTP through the gateway is slower, and slower still beside a busy loop)

    async def run(self, ctx):
        gates = ctx.task.data["gates"]
        if ctx.task.id == "stuck":
            await gates.get_stuck(ctx.task.data["how"])
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        await client.chat.completions.create(model=ctx.model, messages=[
            {"role": "user", "content": ctx.task.prompt}])
        return Result(reward=1.0, info=await gates.until_one_is_stuck())


@pytest.fixture
def gates(monkeypatch):
    monkeypatch.setattr(env_loop, "CANCEL_GRACE_S", 0.1)
    gates = Gates()
    yield gates
    gates.release.set()  # (a busy loop left running would slow the tests after this one)


@pytest.mark.parametrize("agent_cls", [Stuck, StuckChat])
@pytest.mark.parametrize("how", ["sleep", "busy", "ignores_cancellation"])
def test_a_stuck_agent_times_out_and_holds_up_no_other_episode(agent_cls, how, tokenizer,
                                                                gates):
    tasks = [Task(prompt="stuck", id="stuck", data={"how": how, "gates": gates})] + \
        [Task(prompt=f"task {i}", id=str(i), data={"gates": gates}) for i in range(3)]
    tag = f"{agent_cls.__name__}-{how}"
    batch, _ = rollouts(agent_cls, tokenizer, tasks, tag)
    assert not gates.unstuck.is_set()  # all of the below happened while it was stuck:
    assert dict(batch.failed) == {"timeout": 1}
    assert [e["rollout_id"] for e in batch.errors] == [f"{tag}-stuck-0"]
    assert sorted(s.task_id for s in batch.samples) == ["0", "1", "2"]
    assert all(s.info["while_stuck"] for s in batch.samples)
    if how == "ignores_cancellation":  # once its loop stops (after the grace) it never resumes
        assert all_ended(tag) and not gates.unstuck.is_set()


class Judged(Env):
    async def reset(self, task):
        return task.prompt

    async def step(self, action):
        verdict = await self.judge.ask([{"role": "user", "content": f"Rate: {action.text}"}])
        return Result(reward=parse_score(verdict))


class Crashes(Judged):
    def parse_tool_calls(self, text):  # (agent code too, though not async)
        raise ValueError("bad markup")


class Cancels(Judged):
    async def step(self, action):
        raise asyncio.CancelledError  # (as awaiting a task it cancelled itself does)


TASKS = [Task(prompt=f"task {i}", id=str(i)) for i in range(2)]


def test_normal_episodes_and_their_judge_work_and_agent_errors_cost_one_rollout(tokenizer):
    batch, runner = rollouts(Judged, tokenizer, TASKS, "judged", n=2, judge="policy")
    assert [s.reward for s in batch.samples] == [0.7] * 4 and runner.judge.calls == 4
    assert not batch.failed and all_ended("judged")  # no thread keeps an episode's name
    # threads whose episodes ended cleanly wait for the next ones: no new thread is started
    deadline, idle = time.monotonic() + 10, env_loop.AgentThread.idle
    while len(idle) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    pooled = set(map(id, idle))
    batch, _ = rollouts(Judged, tokenizer, TASKS, "again", n=2, judge="policy")
    assert [s.reward for s in batch.samples] == [0.7] * 4 and all_ended("again")
    while len(idle) < len(pooled) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(map(id, idle)) == pooled
    for agent_cls, error in [(Crashes, "ValueError: bad markup"), (Cancels, "CancelledError")]:
        batch, _ = rollouts(agent_cls, tokenizer, TASKS, agent_cls.__name__)
        assert dict(batch.failed) == {"agent_error": 2}
        assert all(error in e["traceback"] for e in batch.errors)


class HangsAfterAnError(ChatAgent):
    timeout_s = 1.0

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key,
                                    max_retries=0)
        with contextlib.suppress(openai.APIError):
            await client.chat.completions.create(model=ctx.model, messages=[
                {"role": "user", "content": ctx.task.prompt}])
        await asyncio.sleep(60)


@pytest.mark.parametrize("agent_cls", [Judged, HangsAfterAnError])
def test_engine_errors_are_not_agent_errors(tokenizer, agent_cls):
    """Even when the agent goes on to time out: the engine's failure is what happened."""
    tag = agent_cls.__name__
    with pytest.raises(RuntimeError, match="engine"):  # it stops the run
        rollouts(agent_cls, tokenizer, TASKS[:1], tag, fail=RuntimeError("engine down"))
    batch, _ = rollouts(agent_cls, tokenizer, TASKS[:1], tag,
                        fail=Requeue("stopped"))  # restarted, then given up on
    assert batch.restarted == MAX_RESTARTS + 1 and dict(batch.failed) == {"restarts": 1}
