"""`instar check-model` on tokenizer folders written here, one per chat-template family: the
built-in models, ChatML/Hermes with reasoning, Llama-3, Mistral, a Qwen3-style template that
drops reasoning from earlier turns, one whose tool calls the parser cannot read, one with the
wrong eos_token and one that re-renders history every turn. Tokenizer and config only; vLLM's
parsers are imported once (some seconds), no engine starts. Its predictions are checked
against instar's real Env loop and gateway session, played with scripted replies."""

import asyncio
import re
import shutil

import pytest
from transformers import AutoTokenizer

from instar.agents.contract import Env, Result, Task
from instar.agents.env_loop import run_env_episode
from instar.check_model import (
    BLOCK,
    OK,
    WARN,
    conversation,
    load,
    prefix_stability,
    reply_text,
    run_checks,
)
from instar.cli import main
from instar.errors import EpisodeError
from instar.gateway.session import Session
from instar.rollout.engine import Generation

CHATML = """\
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}\
{% endfor %}
{%- if tools %}<|im_start|>system
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- set content = m.content %}{% set thought = m.reasoning_content or '' %}
{%- if '</think>' in content %}{% set parts = content.split('</think>') %}\
{% set thought = parts[0].split('<think>')[-1] %}{% set content = parts[-1] %}{% endif %}\
<|im_start|>assistant
{% if thought and loop.index0 > ns.last_query %}<think>{{ thought }}</think>{% endif %}{{ content }}
{%- for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}\
<tool_call>{"name": {{ f.name | tojson }}, "arguments": {{ f.arguments | tojson }}}</tool_call>\
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""Qwen3's way: reasoning (reasoning_content, or <think> in the content) is written only in
the turns after the last user message."""
HERMES = CHATML.replace(" and loop.index0 > ns.last_query", "")
"""ChatML/Hermes that keeps every turn's reasoning."""
BROKEN = "<|im_start|>system\nThis conversation has {{ messages | length }} messages.<|im_end|>\n" \
    + HERMES
"""Re-renders history every turn: its first line counts the messages."""

LLAMA = """\
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
{% for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}\
<|end_header_id|>

{% for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}\
<|python_tag|>{"name": {{ f.name | tojson }}, "parameters": {{ f.arguments | tojson }}}\
{% else %}{{ m.content }}{% endfor %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
LLAMA_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]

MISTRAL = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{% if m.reasoning_content %}[THINK]{{ m.reasoning_content }}\
[/THINK]{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}\
{% set f = c.function if c.function is defined else c %}[TOOL_CALLS]{{ f.name }}[ARGS]\
{{ f.arguments | tojson }}{% endfor %}</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}[INST]{{ m.content }}[/INST]
{%- endif %}
{%- endfor %}"""
"""No generation prompt; user turns have no end token."""
MISTRAL_SPECIAL = ["</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[THINK]",
                   "[/THINK]"]


def checkpoint(tmp_path, tiny_model, template: str | None, tokens=(), special=(), eos=None):
    """A checkpoint folder with the built-in tokenizer given this template and tokens (and the
    built-in config.json; no weights)."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_tokens(list(tokens))
    tok.add_tokens(list(special), special_tokens=True)
    if eos:
        tok.eos_token = eos
    tok.chat_template = template
    out = tmp_path / "model"
    tok.save_pretrained(out)
    shutil.copy(tiny_model / "config.json", out)
    return out


def findings(folder, tool_parser="", reasoning_parser=""):
    """{check: (level, text)} for the folder."""
    return {f.check: (f.level, f.text)
            for f in run_checks(*load(str(folder), tool_parser, reasoning_parser), tool_parser,
                                reasoning_parser)}


def exit_code(folder, *flags) -> int:
    try:
        main(["check-model", str(folder), *flags])
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_the_builtin_models_pass(kind, capsys):
    from instar.tasks.tiny_model import builtin_model

    folder = builtin_model(kind, "tiny", 0)
    assert exit_code(folder) == 0
    out = capsys.readouterr().out
    assert "no blocking problem" in out and "Env continuation" in out
    found = findings(folder)
    assert {level for level, _ in found.values()} == {OK}, found
    assert "hermes reads back the call" in found["tool calls"][1]
    assert found["generation prompt"][1] == repr("<|im_start|>assistant\n")
    replay = found["routing replay"][1]
    assert ("2 routers replay" in replay) if kind == "moe" else "not needed" in replay


def test_chatml_hermes_with_reasoning_passes(tmp_path, tiny_model):
    found = findings(checkpoint(tmp_path, tiny_model, HERMES, ["<think>", "</think>"]))
    assert {level for level, _ in found.values()} == {OK}, found
    assert "qwen3 reads back the reasoning" in found["reasoning"][1]
    assert found["reasoning in history"][1] == "kept in earlier turns"


def test_llama3_passes_and_a_trimming_template_is_outside_the_literal_defence(
        tmp_path, tiny_model):
    found = findings(checkpoint(tmp_path, tiny_model, LLAMA, special=LLAMA_SPECIAL,
                                eos="<|eot_id|>"))
    assert {level for level, _ in found.values()} == {OK}, found
    assert found["generation prompt"][1] == repr("<|start_header_id|>assistant"
                                                 "<|end_header_id|>\n\n")
    assert "llama3_json reads back the call" in found["tool calls"][1]
    assert "'<|eot_id|>'" in found["end of turn"][1]
    trimming = checkpoint(tmp_path, tiny_model, LLAMA.replace("{{ m.content }}",
                                                              "{{ m.content | trim }}"),
                          special=LLAMA_SPECIAL, eos="<|eot_id|>")
    level, text = findings(trimming)["control tokens"]
    assert level == WARN and "literal rendering does not apply" in text


def test_mistral_passes_and_its_markup_prints(tmp_path, tiny_model, capsys):
    folder = checkpoint(tmp_path, tiny_model, MISTRAL, special=MISTRAL_SPECIAL, eos="</s>")
    found = findings(folder)
    assert {level for level, _ in found.values()} == {OK}, found
    assert found["generation prompt"][1] == "''"
    assert "mistral reads back the call" in found["tool calls"][1]
    assert "mistral reads back the reasoning" in found["reasoning"][1]
    assert exit_code(folder) == 0
    assert "[TOOL_CALLS]add[ARGS]" in " ".join(capsys.readouterr().out.split())  # (no markup)


def test_the_wrong_eos_token_blocks(tmp_path, tiny_model, capsys):
    folder = checkpoint(tmp_path, tiny_model, LLAMA, special=LLAMA_SPECIAL)  # eos <|im_end|>
    level, text = findings(folder)["end of turn"]
    assert level == BLOCK and "'<|eot_id|>'" in text and "'<|im_end|>'" in text
    assert exit_code(folder) == 1


def test_a_template_that_drops_reasoning_from_history_is_reported(tmp_path, tiny_model, capsys):
    folder = checkpoint(tmp_path, tiny_model, CHATML, ["<think>", "</think>"])
    found = findings(folder)
    assert found["reasoning in history"] == (
        WARN, "the template drops reasoning from earlier turns (after a user turn)")
    level, text = found["gateway capture"]
    assert level == WARN and "template_rewrites_history" in text and "reasoning: at turn 2" in text
    assert "plain" not in text and "tools:" not in text
    assert found["Env continuation"][0] == WARN
    assert exit_code(folder) == 0  # (a limit, not a blocking problem)
    assert "drops reasoning" in capsys.readouterr().out


def test_a_tool_format_the_parser_cannot_read_is_named_and_blocks(tmp_path, tiny_model, capsys):
    folder = checkpoint(tmp_path, tiny_model, HERMES.replace('"arguments": ', '"parameters": '),
                        ["<think>", "</think>"])
    level, text = findings(folder)["tool calls"]
    assert level == BLOCK and "the tool parser hermes reads no call" in text
    assert exit_code(folder) == 1
    assert "blocking: tool calls" in capsys.readouterr().out
    from instar.tasks.tiny_model import builtin_model  # a parser chosen by flag

    builtin = builtin_model("dense", "tiny", 0)
    assert exit_code(builtin, "--model.tool-parser", "qwen3_coder") == 1
    assert "qwen3_coder reads no call" in findings(builtin, "qwen3_coder")["tool calls"][1]
    no_calls = re.sub(r"\{%- for c in m\.tool_calls.*?\{% endfor %\}", "", HERMES, flags=re.S)
    level, text = findings(checkpoint(tmp_path, tiny_model, no_calls))["tool calls"]
    assert level == WARN and "writes no tool call into history" in text  # (not the parser's)


def test_a_template_that_rewrites_history_is_named_and_blocks(tmp_path, tiny_model, capsys):
    folder = checkpoint(tmp_path, tiny_model, BROKEN, ["<think>", "</think>"])
    found = findings(folder)
    level, text = found["Env continuation"]
    assert level == BLOCK and "at turn 2 the history renders differently" in text
    assert "has 2 messages" in text and "has 3 messages" in text
    assert "plain rewritten" in found["prefix stability"][1]
    assert exit_code(folder) == 1
    assert "blocking: Env continuation" in capsys.readouterr().out


def test_a_bad_folder_or_parser_is_one_line_and_exit_2(tmp_path, tiny_model, capsys):
    bare = checkpoint(tmp_path, tiny_model, None)
    for args, error in [([str(tmp_path / "no")], "not a folder with config.json"),
                        ([str(bare)], "the tokenizer has no chat template"),
                        ([str(tiny_model), "--model.tool-parser", "hermez"],
                         "--model.tool-parser 'hermez' is not a vLLM parser")]:
        assert exit_code(*args) == 2
        err = capsys.readouterr().err
        assert err.startswith("instar check-model: error: ") and error in err, err
        assert err.count("\n") == 1


def played(tok, messages) -> tuple[bool, list[str]]:
    """The episode through instar's real Env loop and gateway session, replies sampled as
    check-model says the model writes them: (the Env episode failed on the template, the
    gateway's reasons for each segment)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    texts = [reply_text(tok, messages[:i], messages[i], None) for i in turns]

    def generation(text):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Generation(ids, [-1.0] * len(ids), [0] * len(ids), "stop", text)

    class Chat(Env):
        max_turns = len(turns)

        async def reset(self, task):
            self.done = 0
            return messages[:turns[0]]

        async def step(self, action):
            self.done += 1
            if self.done == len(turns):
                return Result(0.0)
            return Result(0.0, messages[turns[self.done - 1] + 1:turns[self.done]],
                          terminated=False)

    replies = list(texts)

    async def generate(ids, sampling, images):
        return generation(replies.pop(0))

    try:
        asyncio.run(run_env_episode(Chat(), Task("q"), generate, tok, {"max_tokens": 64}, "r",
                                    "g"))
        env_failed = False
    except EpisodeError as e:
        assert e.reason == "template", e
        env_failed = True
    session = Session(tok, "r", "g", {}, max_turns=10, max_tokens=4096)
    for i, text in zip(turns, texts):
        turn = session.plan(messages[:i], None)
        session.record(turn, messages[:i], None, generation(text), messages[i], None)
    return env_failed, [s.sealed_because for s in session.segments]


@pytest.mark.parametrize("template", ["hermes", "chatml", "broken"])
def test_the_predictions_are_what_instar_does(template, tmp_path, tiny_model):
    """What check-model says of the Env loop and the gateway is what the real ones do with the
    same replies: the episode fails, and the session seals a segment, where it says so."""
    source = {"hermes": HERMES, "chatml": CHATML, "broken": BROKEN}[template]
    _, tok = load(str(checkpoint(tmp_path, tiny_model, source, ["<think>", "</think>"])), "", "")
    stable = prefix_stability(tok)
    for scenario, reasoning in (("plain", False), ("reasoning", True)):
        env_failed, seals = played(tok, conversation(False, reasoning))
        assert env_failed == (stable["env", scenario][0] is not None), (template, scenario)
        rewrites = "template_rewrites_history" in seals
        assert rewrites == (stable["gateway", scenario][0] is not None), (template, scenario)
    assert (stable["gateway", "reasoning"][0] is None) == (template == "hermes")


def test_real_families_templates(tmp_path, tiny_model):
    """Templates written in the style of real families' (tests/test_chat_render.py STYLES):
    Llama 3.1's (calls read as `tool_call.function`: the gateway's requests with tool calls
    used to fail), Qwen2.5's (`if message.content`: literal rendering used to refuse) and
    Phi-3.5's (one more eos_token closing a conversation: every Env continuation used to
    fail) pass, and instar's Env loop and gateway do as predicted; GLM's turns hold no
    eos_token, which is named and blocks (its continuations used to get wrong ids)."""
    from test_chat_render import STYLES

    for name, (template, special, eos) in STYLES.items():
        folder = checkpoint(tmp_path / name, tiny_model, template, special=special, eos=eos)
        found = findings(folder)
        if name == "glm":
            assert found["end of turn"][0] == BLOCK
            level, text = found["Env continuation"]
            assert level == BLOCK and "the reply's turn ends with no '<|user|>'" in text, text
            continue
        if name == "phi3.5":  # (its template writes no tool calls)
            assert found.pop("tool calls")[0] == WARN
        assert {level for level, _ in found.values()} == {OK}, (name, found)
        _, tok = load(str(folder), "", "")
        for tools in (False, True):
            assert played(tok, conversation(tools, False)) == (False, [""]), (name, tools)
