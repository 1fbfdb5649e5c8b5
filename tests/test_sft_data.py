"""SFT data: assistant-only masks read off the chat template, JSONL loading, built-in data."""

import json
import re
from itertools import groupby

import pytest
from transformers import AutoTokenizer

from instar.agents.chat import prompt_ids
from instar.tasks.tiny_model import CHAT_TEMPLATE
from instar.train.sft_data import CALCULATOR, assistant_mask, builtin_sft_data, load_sft_jsonl


def call(expression: str, content: str = "") -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": "calculator",
                                          "arguments": {"expression": expression}}}]}


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+3?"},
    call("2+3"),
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And times 4?"},
    call("5*4", "Let me check."),
    {"role": "tool", "content": "20"},
    {"role": "assistant", "content": "It is 20."},
]
TOOLS_SYSTEM = (
    "<|im_start|>system\nYou are terse.\n# Tools\nCall a tool by replying with "
    '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\n<tools>\n'
    '{"name": "calculator", "description": "Evaluate an arithmetic expression", "parameters": '
    '{"type": "object", "properties": {"expression": {"type": "string"}}, '
    '"required": ["expression"]}}\n</tools><|im_end|>\n')


@pytest.fixture
def tok(tiny_model):
    """A fresh tokenizer per test, so tests may change its template or eos token."""
    return AutoTokenizer.from_pretrained(tiny_model)


def spans(tok, ids: list[int], mask: list[bool]) -> list[tuple[bool, str]]:
    """The sequence as (learned, decoded text) runs."""
    out = []
    for learned, run in groupby(zip(ids, mask), key=lambda p: p[1]):
        out.append((learned, tok.decode([i for i, _ in run])))
    return out


def test_mask_on_multi_turn_tool_chat(tok):
    ids, mask = assistant_mask(tok, CHAT, [CALCULATOR])
    assert spans(tok, ids, mask) == [
        (False, TOOLS_SYSTEM + "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"),
        (True, '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
               "</tool_call><|im_end|>"),
        (False, "\n<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n"),
        (True, "The answer is 5.<|im_end|>"),
        (False, "\n<|im_start|>user\nAnd times 4?<|im_end|>\n<|im_start|>assistant\n"),
        (True, 'Let me check.<tool_call>{"name": "calculator", "arguments": {"expression": "5*4"}}'
               "</tool_call><|im_end|>"),
        (False, "\n<|im_start|>tool\n<tool_response>20</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n"),
        (True, "It is 20.<|im_end|>"),
        (False, "\n"),
    ]
    # every learned span ends on the eos id; the sequence starts as the Env loop's prompt does
    ends = [ids[j] for j in range(len(ids)) if mask[j] and (j + 1 == len(ids) or not mask[j + 1])]
    assert ends == [tok.eos_token_id] * 4
    first = prompt_ids(tok, CHAT[:2], [CALCULATOR])
    assert ids[:len(first)] == first and not any(mask[:len(first)])
    text = tok.apply_chat_template(CHAT, tools=[CALCULATOR], tokenize=False)
    assert ids == tok.encode(text, add_special_tokens=False)


def test_single_turn_and_last_only(tok):
    ids, mask = assistant_mask(tok, [{"role": "user", "content": "Reverse: abcd"},
                                     {"role": "assistant", "content": "dcba"}])
    assert spans(tok, ids, mask) == [
        (False, "<|im_start|>user\nReverse: abcd<|im_end|>\n<|im_start|>assistant\n"),
        (True, "dcba<|im_end|>"), (False, "\n")]
    ids_last, mask_last = assistant_mask(tok, CHAT, [CALCULATOR], last_only=True)
    assert ids_last == assistant_mask(tok, CHAT, [CALCULATOR])[0]
    assert [s for learned, s in spans(tok, ids_last, mask_last) if learned] == ["It is 20.<|im_end|>"]


def test_an_assistant_message_of_weight_0_stays_in_context_unlearned(tok):
    ids, mask = assistant_mask(tok, CHAT, [CALCULATOR])
    weighted = [{**m, "weight": 0} if k in (2, 4) else m for k, m in enumerate(CHAT)]
    ids_w, mask_w = assistant_mask(tok, weighted, [CALCULATOR])
    assert ids_w == ids  # (the template ignores the key: the same tokens, in context)
    assert [s for learned, s in spans(tok, ids_w, mask_w) if learned] == [
        'Let me check.<tool_call>{"name": "calculator", "arguments": {"expression": "5*4"}}'
        "</tool_call><|im_end|>", "It is 20.<|im_end|>"]


def test_turn_without_eos_token_learns_up_to_trailing_whitespace(tok):
    tok.eos_token = "<|endoftext|>"  # the end-of-turn mark is then not the eos token
    ids, mask = assistant_mask(tok, CHAT[1:5], [CALCULATOR])
    learned = [s for is_learned, s in spans(tok, ids, mask) if is_learned]
    assert learned[-1] == "The answer is 5.<|im_end|>"


def test_template_that_rewrites_history_is_refused(tok):
    # past assistant turns render without their content, as templates that drop reasoning do
    head = "<|im_start|>assistant\n{{ text(m.content) }}"
    assert head in CHAT_TEMPLATE
    tok.chat_template = CHAT_TEMPLATE.replace(
        head, "<|im_start|>assistant\n{{ text(m.content) if loop.last else '' }}")
    with pytest.raises(ValueError, match="message 4: the chat template"):  # 2 has no content
        assistant_mask(tok, CHAT, [CALCULATOR])
    ids, mask = assistant_mask(tok, CHAT, [CALCULATOR], last_only=True)
    assert [s for learned, s in spans(tok, ids, mask) if learned] == ["It is 20.<|im_end|>"]


def test_load_errors_name_the_line(tmp_path):
    good = json.dumps({"messages": CHAT[1:5], "tools": [CALCULATOR]})
    cases = {
        "{not json": "not JSON",
        json.dumps({"prompt": "x"}): 'non-empty "messages"',
        json.dumps({"messages": [{"content": "hi"}]}): 'message 0 is not an object with a "role"',
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}): "no assistant message",
        json.dumps({"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo", "weight": 0}]}):
            "no assistant message (of weight 1)",
        json.dumps({"messages": [{"role": "user", "content": "hi", "weight": 1},
                                 {"role": "assistant", "content": "yo"}]}):
            'message 0: "weight" is 0 or 1, on an assistant message',
        json.dumps({"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo", "weight": 0.5}]}):
            'message 1: "weight" is 0 or 1',
        json.dumps({"messages": CHAT[1:5], "tools": "calculator"}): '"tools" must be a list',
    }
    path = tmp_path / "data.jsonl"
    for bad, why in cases.items():
        path.write_text(f"{good}\n\n{bad}\n")
        with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(why)):
            load_sft_jsonl(path)
    path.write_text(f"{good}\n\n")
    assert load_sft_jsonl(path) == [json.loads(good)]
    path.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_sft_jsonl(path)


def test_builtin_data(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from instar.tasks.reverse_data import reverse_data

    path = builtin_sft_data(n_reverse=40, n_calculator=40)
    rows = load_sft_jsonl(path)
    assert builtin_sft_data(n_reverse=40, n_calculator=40).read_text() == path.read_text()
    with open(reverse_data()[1]) as f:
        held_out = {json.loads(line)["prompt"] for line in f}
    reverse = [r for r in rows if "tools" not in r]
    assert len(reverse) == 40 and not {r["messages"][0]["content"] for r in reverse} & held_out
    multi = [r for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) == 4]
    assert len(rows) == 80 and multi
    for row in rows:
        ids, mask = assistant_mask(tok, row["messages"], row.get("tools"))
        learned = [s for is_learned, s in spans(tok, ids, mask) if is_learned]
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(learned) == len(answers)
        assert all(s.endswith("<|im_end|>") for s in learned)
        assert learned[-1] == answers[-1]["content"] + "<|im_end|>"


def test_image_conversations_expand_each_placeholder_as_the_engine_does():
    """`instar sft` on a vision-language model: a shapes demonstration (two images, two turns)
    becomes the tokens a rollout of it has (4 placeholder tokens per 56x56 image, as the
    engine expands them: tests/test_vision.py), the images ride along in order, and only the
    answers are learned. A text-only model refuses images."""
    from instar.tasks.shapes_data import demo
    from instar.tasks.tiny_model import builtin_model
    from instar.train.sft import image_processor, sequence

    base = builtin_model(kind="vl")
    tok = AutoTokenizer.from_pretrained(base)
    row = demo({"prompt": "What colour is the shape?",
                "shapes": [["circle", "red", 20, 20, 9], ["square", "blue", 30, 28, 12]]})
    s = sequence(tok, row, image_processor(base))
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    runs = [len(list(g)) for t, g in groupby(s.tokens) if t == pad]
    assert runs == [4, 4] and s.images == [p["image"] for m in row["messages"][::2]
                                           for p in m["content"][:1]]
    assert tok.decode([t for t, m in zip(s.tokens, s.mask) if m]) == "red<|im_end|>blue<|im_end|>"
    assert not any(m for t, m in zip(s.tokens, s.mask) if t == pad)
    assert image_processor(builtin_model()) is None
    with pytest.raises(ValueError, match="not a vision-language"):
        sequence(tok, row, None)


def test_instar_sft_refuses_bad_images_before_it_starts(tmp_path):
    """A training row with an image that does not decode, or with images for a text-only
    model, is named (file, row) by `sft_inputs`, before any trainer starts."""
    from instar.config import Config
    from instar.sft import sft_inputs
    from instar.tasks.shapes_data import demo

    row = demo({"prompt": "What colour is the shape?",
                "shapes": [["circle", "red", 20, 20, 9], ["square", "blue", 30, 28, 12]]})
    good, bad = json.dumps(row), json.dumps(row).replace("base64,", "base64,!!", 1)
    for kind, lines, error in (("vl", [good, bad], "row 2: the image data does not decode"),
                               ("dense", [good], "row 1: it has images, but .* is not a "
                                                 "vision-language model")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        cfg = Config()
        cfg.model.kind, cfg.data.train, cfg.eval.size = kind, str(path), 0
        with pytest.raises(ValueError, match=error):
            sft_inputs(cfg)
