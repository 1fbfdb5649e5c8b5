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
