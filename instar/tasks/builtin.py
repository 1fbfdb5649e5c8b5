"""The built-in tasks (--data.task): the data, agent and warm-up demonstrations a run takes
where it is given none. Their settings for the built-in model: TASK_SETTINGS in
instar/config.py."""

from pathlib import Path

from instar.tasks.reverse_data import reverse_data
from instar.tasks.tool_use_data import tool_use_data


def task_agent(task: str) -> str:
    """The built-in task's agent file, instar/tasks/<task>.py."""
    return str(Path(__file__).with_name(f"{task}.py"))


def task_data(task: str) -> tuple[str, str, str]:
    """Paths of the built-in task's (train, eval, warm-up demonstrations) JSONL, generated on
    first use; demonstrations "": the warm-up trains on the tasks' labels. tool_use takes
    one-digit facts, the setting it learns from in minutes (docs/scenarios.md)."""
    if task == "reverse":
        return *reverse_data(), ""
    return tool_use_data(digits=1)
