"""The shape of the code, checked: which way imports point, how long functions get, what
loads without Ray. Fast: no engine, no trainer."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
AGENT_FACING = sorted(p for p in (ROOT / "instar" / "agents").glob("*.py"))


def modules(folder: Path) -> list[str]:
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in sorted(folder.glob("*.py"))]


def test_agent_facing_code_imports_neither_torch_nor_ray_nor_vllm():
    """What an agent file imports (instar, instar.agents.*, the built-in tasks' agents) loads
    none of the heavy stack, so an agent is an ordinary Python program."""
    names = ["instar", *modules(ROOT / "instar" / "agents"), "instar.tasks.reverse",
             "instar.tasks.tool_use", "instar.tasks.code_exec", "instar.tasks.shapes"]
    code = (f"import importlib, sys\nfor m in {names!r}: importlib.import_module(m)\n"
            "heavy = {'torch', 'ray', 'vllm'} & set(sys.modules)\n"
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", [ROOT / "instar" / "sft.py", ROOT / "instar" / "jobs.py",
                                  *sorted((ROOT / "benchmarks").glob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_rl_command_imports_the_loop(path):
    assert "instar.loop" not in imports_of(path)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted((ROOT / "instar").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long
