"""Each example runs on the model taught to use the calculator (conftest), so tool calls are
real: one through `instar rollout` (its command in this process), the others on the tests'
shared engine."""

import json
from pathlib import Path

import pytest
from conftest import instar

from instar.agents.loading import load_agent, load_tasks
from instar.rollout.runner import Rollouts
from instar.sample import read_jsonl

pytestmark = pytest.mark.stack

EXAMPLES = Path(__file__).parents[1] / "examples"


CALCULATOR = EXAMPLES / "data" / "calculator.jsonl"
SAMPLING = {"temperature": 0.3, "max_tokens": 40}  # low temperature: the taught path, reliably


def check(name: str, samples: list, failed: dict) -> None:
    assert len({s.rollout_id for s in samples}) == 16 and failed == {}, failed
    first = [s for s in samples if s.rollout_id.endswith("add-2-3-0")]
    if name == "compacting_agent":
        assert [s.segment for s in first] == [0, 1]
        assert first[0].info["sealed_because"] == "history_rewritten"
    else:  # the taught task: a calculator call, its result, then the answer
        assert len(first) == 1 and first[0].reward == 1.0, first[0].info


def test_instar_rollout_runs_an_example_as_a_user_does(tool_model, ray_session, tmp_path):
    """The tasks as a Parquet file with columns of its own (`--data.prompt-key`, ...); the
    agent drives the model through the OpenAI Responses API (`client.responses.create`)."""
    import datasets

    parquet = tmp_path / "calculator.parquet"
    datasets.Dataset.from_list([{"id": t.id, "question": t.prompt, "answer": t.label}
                                for t in load_tasks(str(CALCULATOR))]).to_parquet(parquet)
    run = instar(tmp_path, "rollout", "--agent", str(EXAMPLES / "calculator_responses.py"),
                 "--data.train", str(parquet), "--data.prompt-key", "question",
                 "--data.label-key", "answer", "--model.path", str(tool_model),
                 "--rollout.group-size", "2", "--rollout.max-tokens", str(SAMPLING["max_tokens"]),
                 "--rollout.max-model-len", "512",
                 "--rollout.temperature", str(SAMPLING["temperature"]))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["episodes"] == 16, summary
    samples = read_jsonl(run / "rollouts.jsonl")
    check("calculator_responses", samples, summary["failed"])
    assert all(lp is not None for s in samples for lp, m in zip(s.logprobs, s.loss_mask) if m)


@pytest.mark.parametrize("name", ["calculator_env", "tool_use_openai", "compacting_agent",
                                  "calculator_anthropic"])
def test_each_example_runs_on_the_shared_engine(name, tool_engine, tokenizer):
    rollouts = Rollouts(load_agent(str(EXAMPLES / f"{name}.py")), {}, [tool_engine], tokenizer,
                        model_name="tool_model", max_model_len=512,
                        limits={"timeout_s": 180})  # a hang: one failed rollout, told where
    try:
        batch = rollouts.run(load_tasks(str(CALCULATOR)), 2, SAMPLING, "rollout")
    finally:
        rollouts.close()
    assert not batch.errors, [e["traceback"].splitlines()[-1] for e in batch.errors]
    check(name, batch.samples, dict(batch.failed))
