"""Load a user's agent file and task data. No torch, no ray."""

import importlib.util
import json
from pathlib import Path

from instar.agents.contract import ChatAgent, Env, Task


def load_agent(path: str) -> type[Env] | type[ChatAgent]:
    """Import the Python file at `path` and return its `AgentRunner`."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"agent file {path} not found (--agent.file)")
    spec = importlib.util.spec_from_file_location(f"instar_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runner = getattr(module, "AgentRunner", None)
    if not (isinstance(runner, type) and issubclass(runner, (Env, ChatAgent))):
        raise TypeError(f"{path} must define AgentRunner = <an Env or ChatAgent subclass>")
    return runner


def load_tasks(path: str) -> list[Task]:
    """Read a JSONL file of tasks; each row needs `prompt`, may have `label` and `id`."""
    tasks = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row:
                raise ValueError(f"{path}:{i + 1}: a task row needs a 'prompt' field")
            tasks.append(Task(prompt=row["prompt"], label=row.get("label"),
                              id=str(row.get("id", i)), data=row))
    return tasks
