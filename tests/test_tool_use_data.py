"""The tool-use data (instar/tasks/tool_use_data.py), tokenizer only: the one-digit variant the
measured run learns from (docs/scenarios.md section 1) keeps a held-out split of unseen
questions and tables, and each fact value is one token, the same in the tool's result, the
calculator call and the answer."""

import json

import pytest
from transformers import AutoTokenizer

from instar.tasks.tool_use_data import demo, tool_use_data


def rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_one_digit_split_and_tokens(tiny_model):
    train, held_out, demos = (rows(p) for p in tool_use_data(digits=1))
    assert len(train) == 3000 and len(held_out) == 64 and len(demos) == 2000
    asked = {r["prompt"] for r in train}
    assert not any(r["prompt"] in asked for r in held_out)  # unseen questions
    tables = {json.dumps(r["facts"], sort_keys=True) for r in train}
    assert sum(json.dumps(r["facts"], sort_keys=True) in tables for r in held_out) <= 2
    values = {v for r in train + held_out for v in r["facts"].values()}
    assert values == set(range(1, 10))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for row in held_out[:20]:
        messages = demo(row)["messages"]
        for v in (row["facts"][k] for k in row["needed"]):
            assert len(tok.tokenize(str(v))) == 1
            assert tok.tokenize(f"<tool_response>{v}</tool_response>")[1] == tok.tokenize(str(v))[0]
        # the answer's tokens are the last tool result's tokens
        assert tok.tokenize(messages[-1]["content"]) == tok.tokenize(messages[-2]["content"])


def test_default_data_unchanged_and_bad_digits():
    assert "-d" not in tool_use_data()[0].split("/")[-2]
    assert all(10 <= v <= 999 for r in rows(tool_use_data()[1]) for v in r["facts"].values())
    with pytest.raises(ValueError, match="digits must be 1, 2 or 3"):
        tool_use_data(digits=4)
