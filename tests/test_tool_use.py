"""The built-in tool-use task, as an Env and as a ChatAgent, on the tiny model taught one
demonstration (conftest's `teach`): two lookups, a calculator call,
the answer. Checks the tool calls, the observations between turns (the tools' results,
rendered by the chat template, never trained on) and the reward."""

import json

import pytest
from conftest import serve_model, teach
from transformers import AutoTokenizer

from instar.agents.loading import load_agent, load_tasks
from instar.rollout.parsers import Parsers
from instar.rollout.runner import Rollouts
from instar.tasks.tool_use_data import demo, tool_use_data
from instar.tasks.tools import call_tool

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def taught(tiny_model, tmp_path_factory):
    """(model, tasks file, the taught task): a `sum` task and three other train tasks."""
    tmp = tmp_path_factory.mktemp("tool_use")
    with open(tool_use_data()[0]) as f:
        rows = [json.loads(next(f)) for _ in range(4)]
    row = rows[1]
    assert row["kind"] == "sum"
    lesson = demo(row)
    model = teach(tiny_model, tmp / "model", [lesson["messages"]], lesson["tools"], steps=150)
    (tmp / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, tmp / "tasks.jsonl", row


def runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal mask values: (value, start, end)."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


@pytest.fixture(scope="module")
def taught_engine(ray_session, taught):
    yield from serve_model(taught[0], max_model_len=1024)


@pytest.mark.parametrize("agent", ["instar/tasks/tool_use.py", "examples/tool_use_openai.py"])
def test_tool_use_env_and_chat_agent(agent, taught, taught_engine):
    model, tasks, row = taught
    tok = AutoTokenizer.from_pretrained(model)
    rollouts = Rollouts(load_agent(agent), {}, [taught_engine], tok, model_name="taught",
                        max_model_len=1024, limits={})
    try:
        batch = rollouts.run(load_tasks(str(tasks)), 2, {"temperature": 0.3, "max_tokens": 96},
                             "rollout")
    finally:
        rollouts.close()
    samples = batch.samples
    assert len({s.rollout_id for s in samples}) == 8 and not batch.failed, batch.failed
    assert all(s.reward in (0.0, 1.0) for s in samples)
    (s,) = [s for s in samples if s.rollout_id == f"rollout-{row['id']}-0"]
    assert s.reward == 1.0 and s.info["tool_calls"] == 3, s.info
    tok = AutoTokenizer.from_pretrained(model)
    pieces = runs(s.loss_mask)  # prompt, turn 1, observation, turn 2, observation, turn 3
    assert [m for m, _, _ in pieces] == [False, True, False, True, False, True]
    turns = [s.tokens[a:b] for m, a, b in pieces if m]
    calls = [Parsers(tok).parse(tok.decode(t)).tool_calls for t in turns]
    assert [[c["name"] for c in turn] for turn in calls] == [["lookup", "lookup"],
                                                             ["calculator"], []]
    assert [c["arguments"]["key"] for c in calls[0]] == row["needed"]
    for turn, (_, a, b) in zip(calls, pieces[2::2]):  # the tools' results, as the template
        results = [call_tool(c, row["facts"]) for c in turn]  # renders tool turns (ChatML)
        text = "\n" + "".join(f"<|im_start|>tool\n<tool_response>{r}</tool_response>"
                              "<|im_end|>\n" for r in results) + "<|im_start|>assistant\n"
        assert s.tokens[a:b] == tok.encode(text, add_special_tokens=False)
    assert str(row["label"]) in tok.decode(turns[-1])
    assert all(lp is None for lp, m in zip(s.logprobs, s.loss_mask) if not m)
