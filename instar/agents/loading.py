"""Load a user's agent file and task data. No torch, no ray."""

import importlib.util
import inspect
import json
import sys
from pathlib import Path

from instar.agents.contract import ChatAgent, Env, Task


def load_agent(spec: str) -> type[Env] | type[ChatAgent]:
    """Import `path.py` and return its `AgentRunner`, or the class named in `path.py:Name`."""
    path, _, name = spec.partition(":")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"agent file {path} not found (--agent)")
    folder = str(file.resolve().parent)
    if folder not in sys.path:  # so the agent can import modules that sit beside it
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(f"instar_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    runner = getattr(module, name or "AgentRunner", None)
    if not (isinstance(runner, type) and issubclass(runner, (Env, ChatAgent))
            and runner not in (Env, ChatAgent)):
        raise TypeError(f"{path} must define {name or 'AgentRunner'} as a subclass of "
                        "instar.Env or instar.ChatAgent (e.g. `AgentRunner = MyEnv`)")
    for hook in ("run",) if issubclass(runner, ChatAgent) else ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(runner, hook)):  # (the Gymnasium habit)
            raise TypeError(f"{path}: {runner.__name__}.{hook} must be `async def {hook}(...)`: "
                            "instar awaits it")
    return runner


def load_tasks(path: str) -> list[Task]:
    """Read a JSONL file of tasks; each row needs `prompt`, may have `label` and `id`."""
    tasks = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not JSON ({e.msg}, column {e.colno})") from e
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{path}:{i + 1}: a task row needs a 'prompt' field")
            tasks.append(Task(prompt=row["prompt"], label=row.get("label"),
                              id=str(row.get("id", i)), data=row))
    return tasks
