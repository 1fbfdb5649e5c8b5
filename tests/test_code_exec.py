"""The built-in code-execution task: submissions run against tests in the sandbox; the
outcome is the reward or the next observation. On the tiny model (which cannot write code)
the tests check the mechanics: the code ran in the sandbox, its outcome is in `info`, the
reward is the fraction passed, and a submission that crashes or tries to escape costs only
its own reward."""

import asyncio
import json
import re

import pytest
from conftest import serve_model, teach
from transformers import AutoTokenizer

from instar import Action, Task
from instar.agents.loading import load_agent, load_tasks
from instar.rollout.runner import Rollouts
from instar.tasks.code_exec import CodeExec
from instar.tasks.code_exec_data import FAMILIES, code_exec_data, code_exec_demos

LIMITS = dict(cpu_s=1.0, wall_s=8.0, memory_mb=128)


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    with open(code_exec_data()[1]) as f:
        rows = [json.loads(line) for line in f][:4]
    return [Task(prompt=r["prompt"], label=r["label"], id=r["id"], data=r) for r in rows]


def attempt(env: CodeExec, code: str):
    return asyncio.run(env.step(Action(code, [])))


def test_reward_is_the_last_attempts_fraction_and_failures_are_fed_back(tasks):
    task = tasks[0]
    env = CodeExec()
    env.limits = LIMITS
    asyncio.run(env.reset(task))
    first = attempt(env, "def f(*args):\n    return None\n")  # wrong on every test
    assert first.reward == 0.0 and not first.terminated
    assert first.observation.startswith("0 of 4 tests passed.")
    assert "returned None, expected" in first.observation  # compared outside the sandbox
    assert first.info | {"exec_s": 0} == {"passed": 0, "tests": 4, "attempts": 1, "exit_code": 0,
                                          "violation": "", "exec_s": 0}
    second = attempt(env, f"```python\n{task.label}```")  # the fenced block is the code
    assert second.terminated and second.reward == 1.0 and second.info["passed"] == 4
    env = CodeExec()
    env.limits = LIMITS
    asyncio.run(env.reset(task))
    assert attempt(env, task.label).reward == 1.0
    worse = attempt(env, "def f(")
    assert worse.terminated and worse.reward == -1.0  # the episode's sum: 0, the last attempt
    assert worse.info["exit_code"] == 1 and worse.info["passed"] == 0


def test_demos_feed_back_what_the_task_reports(tasks):
    """The demonstrations: the reference solution, or (about a quarter) a wrong first attempt,
    the report CodeExec gives on it, word for word, and then the reference solution. No
    held-out (family, k) occurs."""
    with open(code_exec_data()[0]) as f:
        train = [json.loads(line) for line in f]
    with open(code_exec_data()[1]) as f:
        held_out = {r["id"].rsplit("-", 1)[0] for r in map(json.loads, f)}
    with open(code_exec_demos()) as f:
        demos = [json.loads(line)["messages"] for line in f]
    assert len(demos) == 2000 and 400 < sum(len(m) == 4 for m in demos) < 600
    fixes = []
    for row, messages in zip(train, demos):
        assert row["id"].rsplit("-", 1)[0] not in held_out
        assert messages[0] == {"role": "user", "content": row["prompt"]}
        assert messages[-1] == {"role": "assistant", "content": row["label"]}
        assert [m["role"] for m in messages] in (["user", "assistant"],
                                                 ["user", "assistant", "user", "assistant"])
        if len(messages) == 4:
            assert messages[1]["content"] != row["label"]
            fixes.append((row, messages))
    for row, messages in fixes[:3]:  # the report is the task's own
        env = CodeExec()
        env.limits = LIMITS
        asyncio.run(env.reset(Task(prompt=row["prompt"], label=row["label"], id=row["id"],
                                   data=row)))
        first = attempt(env, messages[1]["content"])
        assert not first.terminated and first.observation == messages[2]["content"]
        assert attempt(env, messages[3]["content"]).reward == 1.0 - first.info["passed"] / 4


ESCAPES = {  # submission -> the violation the sandbox reports
    "import os\nwhile True:\n    os.fork()": "processes",
    "while True:\n    pass": "time",
    "while True:\n    print('y' * 1000)": "output",
    "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))": "memory",
    "print(open('/etc/passwd').read())": "filesystem",
    "import socket\nsocket.create_connection(('127.0.0.1', 80))": "network",
}


class Scripted(CodeExec):
    """Submits a fixed program per task instead of the model's text: an escape attempt on
    tasks 0-5, the reference solution on the others."""

    limits = LIMITS
    max_turns = 1

    async def reset(self, task):
        self.code = list(ESCAPES)[int(task.id)] if int(task.id) < len(ESCAPES) else task.label
        return await super().reset(task)

    async def step(self, action):
        return await super().step(Action(self.code, action.token_ids))


@pytest.mark.stack
def test_escapes_cost_only_their_own_reward(engine, tokenizer, tasks):
    batch_tasks = [Task(prompt=t.prompt, label=t.label, id=str(i), data=t.data)
                   for i, t in enumerate(tasks * 2)]
    runner = Rollouts(Scripted, {}, [engine], tokenizer, model_name="tiny", max_model_len=512,
                      limits={})
    try:
        batch = runner.run(batch_tasks, 1, {"temperature": 1.0, "max_tokens": 4}, "esc")
    finally:
        runner.close()
    assert dict(batch.failed) == {} and len(batch.samples) == 8
    by_task = {int(s.rollout_id.split("-")[1]): s for s in batch.samples}
    for i, expected in enumerate(ESCAPES.values()):
        s = by_task[i]
        violation = s.info["violation"]
        assert (violation in ("cpu_time", "wall_time") if expected == "time"
                else violation == expected), (i, s.info)
        assert s.reward == 0.0 and s.info["passed"] == 0
    for i in (6, 7):  # the same batch, unharmed
        assert by_task[i].reward == 1.0 and by_task[i].info["violation"] == ""


@pytest.mark.stack
@pytest.mark.parametrize("agent", ["instar/tasks/code_exec.py", "examples/code_exec_openai.py"])
def test_code_exec_on_the_tiny_model(agent, engine, tokenizer, tasks):
    """Env and ChatAgent through the runner: whatever the model writes runs in the sandbox
    and its outcome is recorded; a failed first attempt's report is the second turn's input."""
    runner = Rollouts(load_agent(agent), {}, [engine], tokenizer, model_name="tiny",
                      max_model_len=512, limits={})
    # a bias on the end-of-turn token: short turns, so both attempts fit
    sampling = {"temperature": 1.0, "max_tokens": 12, "logit_bias": {tokenizer.eos_token_id: 4.0}}
    try:
        batch = runner.run(tasks, 2, sampling, "code")
    finally:
        runner.close()
    assert dict(batch.failed) == {} and len({s.rollout_id for s in batch.samples}) == 8
    for s in batch.samples:
        info = s.info
        assert info["tests"] == 4 and 0 <= info["passed"] <= 4 and info["attempts"] in (1, 2)
        assert isinstance(info["exit_code"], int) and isinstance(info["violation"], str)
        assert 0.0 <= s.reward <= 1.0 and s.reward == info["passed"] / 4
    two = [s for s in batch.samples if s.info["attempts"] == 2]
    assert two, "no episode reached a second attempt"
    for s in two:  # the observation: the test report as a user turn, not trained on
        starts = [i for i in range(1, len(s.tokens)) if s.loss_mask[i] and not s.loss_mask[i - 1]]
        ends = [i for i in range(1, len(s.tokens)) if not s.loss_mask[i] and s.loss_mask[i - 1]]
        observation = tokenizer.decode(s.tokens[ends[0]:starts[1]])
        assert "<|im_start|>user\n" in observation and " of 4 tests passed." in observation



def held_out_after_sft(base, tmp_path, steps: int = 200):
    """The model after `steps` SFT steps (batch 16) on the demonstrations, and its greedy
    two-attempt episodes on the 32 held-out tasks: (task row, first attempt's code, sample)."""
    with open(code_exec_demos()) as f:
        lessons = [json.loads(line)["messages"] for line in f]
    model = teach(base, tmp_path / "model", lessons, None, steps=steps, batch=16)
    tok = AutoTokenizer.from_pretrained(model)
    engine = serve_model(model, max_model_len=1024)
    rollouts = Rollouts(CodeExec, {}, [next(engine)], tok, model_name="sft", max_model_len=1024,
                        limits={})
    try:
        batch = rollouts.run(load_tasks(code_exec_data()[1]), 1,
                             {"temperature": 0.0, "max_tokens": 48}, "eval")
    finally:
        rollouts.close()
        next(engine, None)
    assert len(batch.samples) == 32 and not batch.failed, batch.failed
    with open(code_exec_data()[1]) as f:
        rows = {f"eval-{r['id']}-0": r for r in map(json.loads, f)}
    out = []
    for s in batch.samples:
        m = s.loss_mask
        start = next(i for i in range(len(m)) if m[i])
        end = next((i for i in range(start, len(m)) if not m[i]), len(m))
        code = tok.decode(s.tokens[start:end]).removesuffix(tok.eos_token)
        out.append((rows[s.rollout_id], code, s))
    return out


@pytest.mark.stack
def test_writes_unseen_functions_after_short_sft(tiny_model, ray_session, tmp_path):
    """A learning signal of the measured run's first stage (benchmarks/scenarios.py
    code_exec), on the 32 held-out tasks, whose (function, constant) pairs no lesson shows,
    after 200 SFT steps on the demonstrations (batch 16): the greedy first attempt is the
    asked function (its reference body with some constant) in at least 28 of 32. The
    untrained model passes no test. Picking among the functions of the asked argument at
    random (1/5 for x, 1/3 for s) gets 28 or more right with p < 4e-10. Measured (tiny model
    seeds 0, 1, 2): 32 of 32 each. Copying the constant forms later and when depends on the
    seed: first attempts passing all 4 tests were 3, 2, 1 at 200 steps and 13, 12, 3 at 300
    (the scenario's 400 steps reach a held-out pass rate of 0.81), so the test asks for the
    function, not the constant (a right function with one of the 19 constants drawn at random
    passes all tests 1.7 times in 32)."""
    right_function = 0
    for row, code, _ in held_out_after_sft(tiny_model, tmp_path):
        arg, _, body = FAMILIES[row["id"].split("-")[0]]
        pattern = re.escape(f"def f({arg}):\n    return {body}\n").replace(r"\{k\}", r"\d+")
        right_function += re.fullmatch(pattern, code) is not None
    assert right_function >= 28, right_function
