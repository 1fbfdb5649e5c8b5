"""Load a user's agent file and task data. No torch, no ray."""

import ast
import importlib.util
import inspect
import json
import sys
from pathlib import Path

from instar.agents.contract import ChatAgent, Env, Task


def check_agent_file(spec: str) -> None:
    """Check `path.py[:Name]` without running it: it parses, defines the class, and the hooks
    its classes in this file define are `async def` (ValueError or TypeError otherwise)."""
    path, _, name = spec.partition(":")
    name = name or "AgentRunner"
    if not Path(path).is_file():
        raise FileNotFoundError(f"agent file {path} not found (--agent)")
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except SyntaxError as e:
        raise ValueError(f"agent file {path}:{e.lineno}: {e.msg}") from e
    bound = {}  # top-level name -> its class definition, the name it aliases, or None
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            bound[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = node.value.id if isinstance(node.value, ast.Name) else None
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
    if name not in bound:
        raise ValueError(f"agent file {path} defines no {name}: name the agent class with "
                         f"--agent {path}:ClassName, or add `AgentRunner = YourClass`")
    chain, todo = [], [name]  # the class and its bases defined in this file
    while todo:
        node = bound.get(todo.pop())
        if isinstance(node, str):
            todo.append(node)
        elif isinstance(node, ast.ClassDef) and node not in chain:
            chain.append(node)
            todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
    bases = {getattr(b, "id", getattr(b, "attr", "")) for c in chain for b in c.bases}
    hooks = ("run",) if "ChatAgent" in bases else ("reset", "step")
    for c in chain:
        for f in c.body:
            if isinstance(f, ast.FunctionDef) and f.name in hooks:  # (the Gymnasium habit)
                raise TypeError(f"{path}:{f.lineno}: {c.name}.{f.name} must be `async def "
                                f"{f.name}(...)`: instar awaits it")


def load_agent(spec: str) -> type[Env] | type[ChatAgent]:
    """Import `path.py` and return its `AgentRunner`, or the class named in `path.py:Name`
    (checked first, without running it: `check_agent_file`)."""
    check_agent_file(spec)
    path, _, name = spec.partition(":")
    file = Path(path)
    folder = str(file.resolve().parent)
    if folder not in sys.path:  # so the agent can import modules that sit beside it
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(f"instar_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"agent file {path}: importing it raised {e!r}") from e
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


def load_tasks(path: str, prompt_key: str = "prompt", label_key: str = "label") -> list[Task]:
    """Read a JSONL file of tasks; each row needs the prompt column (`--data.prompt-key`), may
    have `id` and the label column (`--data.label-key`; needed when not the default `label`).
    Other formats: instar/data.py."""
    tasks = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not JSON ({e.msg}, column {e.colno})") from e
            if not isinstance(row, dict) or prompt_key not in row:
                raise ValueError(f"{path}:{i + 1}: a task row needs a {prompt_key!r} field (the "
                                 "prompt column: --data.prompt-key)")
            if label_key != "label" and label_key not in row:
                raise ValueError(f"{path}:{i + 1}: a task row needs a {label_key!r} field (the "
                                 "label column: --data.label-key)")
            tasks.append(Task(prompt=row[prompt_key], label=row.get(label_key),
                              id=str(row.get("id", i)), data=row))
    return tasks
