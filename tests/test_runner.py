"""Rollouts over a batch: failing and hanging agents cost their own rollout only."""

import asyncio

import openai
import pytest

from instar import ChatAgent, Env, Result, Task
from instar.rollout.runner import Rollouts

pytestmark = pytest.mark.stack

SAMPLING = {"temperature": 1.0, "max_tokens": 4}
TASKS = [Task(prompt=f"task {i}", id=str(i)) for i in range(4)]


class Flaky(Env):
    """Raises on task 1, hangs on task 2, works on the others."""

    timeout_s = 1.0

    async def reset(self, task):
        self.id = task.id
        return task.prompt

    async def step(self, action):
        if self.id == "1":
            raise RuntimeError("tool crashed")
        if self.id == "2":
            await asyncio.sleep(30)
        return Result(reward=1.0)


class FlakyChat(ChatAgent):
    timeout_s = 5.0

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)
        await client.chat.completions.create(model=ctx.model, messages=[
            {"role": "user", "content": ctx.task.prompt}])
        if ctx.task.id == "1":
            raise ValueError("parse error")
        if ctx.task.id == "2":
            await asyncio.sleep(30)
        return Result(reward=1.0, info={"ok": True})


def run(agent_cls, engine, tokenizer, limits=None):
    runner = Rollouts(agent_cls, {}, [engine], tokenizer, model_name="tiny", max_model_len=512,
                      limits=limits or {})
    try:
        return runner.run(TASKS, 2, SAMPLING, "t")
    finally:
        runner.close()


def test_env_failures_are_counted_and_the_batch_completes(engine, tokenizer):
    batch = run(Flaky, engine, tokenizer)
    assert dict(batch.failed) == {"agent_error": 2, "timeout": 2}
    assert sorted(s.rollout_id for s in batch.samples) == ["t-0-0", "t-0-1", "t-3-0", "t-3-1"]
    assert all("RuntimeError: tool crashed" in e["traceback"] for e in batch.errors
               if e["reason"] == "agent_error")
    assert all("in the agent's step (turn 1) for the last" in e["traceback"]
               for e in batch.errors if e["reason"] == "timeout")  # where it hung, told


def test_chat_agent_failures_are_counted_and_the_batch_completes(engine, tokenizer):
    batch = run(FlakyChat, engine, tokenizer)
    assert dict(batch.failed) == {"agent_error": 2, "timeout": 2}
    assert len({s.rollout_id for s in batch.samples}) == 4
    assert all(s.info["ok"] for s in batch.samples)
    assert all("no request with the engine (1 answered): the agent's own code" in e["traceback"]
               for e in batch.errors if e["reason"] == "timeout")  # where it hung, told


def test_run_config_overrides_agent_limits(engine, tokenizer):
    batch = run(Flaky, engine, tokenizer, limits={"timeout_s": 0.01, "max_turns": None})
    assert batch.failed["timeout"] == 8 and not batch.samples


class FailsOnce(Env):
    """Task 1's first attempt crashes (a fresh environment then works); task 2 always crashes."""

    attempts: dict = {}

    async def reset(self, task):
        self.id = task.id
        FailsOnce.attempts[task.id] = self.attempt = FailsOnce.attempts.get(task.id, 0) + 1
        return task.prompt

    async def step(self, action):
        if self.id == "2" or (self.id == "1" and self.attempt == 1):
            raise RuntimeError("flaky tool")
        return Result(reward=1.0)


def run_policy(engine, tokenizer, policy):
    FailsOnce.attempts = {}
    runner = Rollouts(FailsOnce, {}, [engine], tokenizer, model_name="tiny", max_model_len=512,
                      limits={}, on_failure=policy, max_retries=2)
    try:  # one rollout per task, so a task's attempts are its rollout's
        return runner.run(TASKS, 1, SAMPLING, "t")
    finally:
        runner.close()


def test_failure_policy_retry_gives_a_fresh_environment(engine, tokenizer):
    batch = run_policy(engine, tokenizer, "retry")
    assert FailsOnce.attempts == {"0": 1, "1": 2, "2": 3, "3": 1}  # 2 retries at most
    assert sorted(s.group_id for s in batch.samples) == ["t-0", "t-1", "t-3"]
    assert batch.retried == 3 and dict(batch.failed) == {"agent_error": 1}
    assert len(batch.errors) == 4  # every failed attempt is recorded


def test_failure_policy_drop_group_drops_the_whole_group(engine, tokenizer):
    FailsOnce.attempts = {}
    runner = Rollouts(FailsOnce, {}, [engine], tokenizer, model_name="tiny", max_model_len=512,
                      limits={}, on_failure="drop_group")
    try:
        batch = runner.run(TASKS[:2], 2, SAMPLING, "t")  # one of task 1's two rollouts fails
    finally:
        runner.close()
    assert sorted(s.group_id for s in batch.samples) == ["t-0", "t-0"]
    assert batch.dropped_groups == 1 and dict(batch.failed) == {"agent_error": 1}
    assert run_policy(engine, tokenizer, "drop_rollout").failed == {"agent_error": 2}
