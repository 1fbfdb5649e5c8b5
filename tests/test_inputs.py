"""A user's agent file and task data are checked when loaded, with the file (and line) named:
no engine starts for an agent instar cannot await or a dataset it cannot read."""

import pytest

from instar.agents.loading import load_agent, load_tasks

SYNC_ENV = """
from instar import Env, Result

class Gym(Env):
    def reset(self, task):  # the Gymnasium habit: not async
        return task.prompt

    async def step(self, action):
        return Result(reward=0.0)

AgentRunner = Gym
"""

SYNC_CHAT = """
from instar import ChatAgent, Result

class Chat(ChatAgent):
    def run(self, ctx):
        return Result(reward=0.0)

AgentRunner = Chat
"""


@pytest.mark.parametrize("code, hook", [(SYNC_ENV, "Gym.reset"), (SYNC_CHAT, "Chat.run")])
def test_an_agent_whose_hooks_are_not_async_is_refused_at_load(tmp_path, code, hook):
    path = tmp_path / "agent.py"
    path.write_text(code)
    with pytest.raises(TypeError, match=f"{hook} must be `async def"):
        load_agent(str(path))


def test_a_bad_task_row_names_its_file_and_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b",}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not JSON"):
        load_tasks(str(path))
    path.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(ValueError, match=f"{path}:2: a task row needs a 'prompt' field"):
        load_tasks(str(path))


def test_the_built_in_task_supplies_what_the_run_is_not_given(tmp_path):
    """`--data.task` names the built-in task whose data, agent and warm-up demonstrations fill
    in what the flags leave out: tool use by default (its warm-up on the demonstrations of
    lookups and calculator calls), reverse on request (a warm-up on the tasks' labels), and a
    user's --train.warmup-sft-data over either."""
    from instar.cli import parse
    from instar.inputs import run_inputs

    default = run_inputs(parse("rl", [])[0])
    assert default.agent_cls.__name__ == "ToolUse" and default.eval_tasks
    assert default.train_tasks[0].data["facts"] and len(default.eval_tasks) == 64
    assert len(default.warmup_rows) == 2000
    assert all(any("tool_calls" in m for m in row["messages"]) for row in default.warmup_rows)
    reverse = run_inputs(parse("rl", ["--data.task", "reverse"])[0])
    assert reverse.agent_cls.__name__ == "Reverse" and reverse.warmup_rows is None
    assert reverse.train_tasks[0].prompt.startswith("Reverse: ")
    demos = tmp_path / "demos.jsonl"
    demos.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                     '{"role": "assistant", "content": "hello"}]}\n')
    own = run_inputs(parse("rl", ["--train.warmup-sft-data", str(demos)])[0])
    assert own.agent_cls.__name__ == "ToolUse" and len(own.warmup_rows) == 1
    none = run_inputs(parse("rl", ["--train.warmup-sft-steps", "0"])[0])
    assert none.warmup_rows is None  # (no warm-up: the demonstrations are not read)
