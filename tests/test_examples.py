"""Each example runs through `instar rollout`, the way a user runs it, and writes valid JSONL.

The model is the tiny one taught to use the calculator (conftest), so tool calls are real.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from instar.sample import read_jsonl

pytestmark = pytest.mark.stack

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.parametrize("name", ["calculator_env", "tool_use_openai", "calculator_anthropic",
                                  "compacting_agent"])
def test_instar_rollout_runs_each_example(name, tool_model, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "instar.cli", "rollout", "--agent", str(EXAMPLES / f"{name}.py"),
         "--data.train", str(EXAMPLES / "data" / "calculator.jsonl"),
         "--model.path", str(tool_model), "--rollout.group-size", "2",
         "--rollout.max-tokens", "40", "--rollout.max-model-len", "512",
         "--rollout.temperature", "0.3",  # low: the taught path, reliably
         "--logging.root", str(tmp_path), "--logging.name", "run"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    samples = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["episodes"] == 16 and summary["failed"] == {}, summary
    assert len({s.rollout_id for s in samples}) == 16
    first = [s for s in samples if s.rollout_id.endswith("add-2-3-0")]
    if name == "compacting_agent":
        assert [s.segment for s in first] == [0, 1]
        assert first[0].info["sealed_because"] == "history_rewritten"
    else:  # the taught task: a calculator call, its result, then the answer
        assert len(first) == 1 and first[0].reward == 1.0, first[0].info
