"""Rendering only what is new (instar/agents/chat.py `continuation`): the same ids as
`continuation_ids`, which renders the conversation in full, on many seeded conversations
and several templates (the built-in ones, model families' written here, a Qwen3-style template
that rewrites history, and closing texts that get in the way); which templates count as
rendering each message on its own; and how much is rendered per turn. Then what real
families' templates need (Llama 3.1's `tool_call.function`, Qwen2.5's `if message.content`,
Phi-3.5's closing eos_token, GLM's turns without one), on templates written here in their
style. Tokenizer only, no engine."""

import random

import pytest
from test_parsers import FAMILIES, family_tokenizer
from transformers import AutoTokenizer

from instar.agents.chat import (
    _local,
    _marked,
    canonical,
    continuation,
    continuation_ids,
    encode,
    prompt_ids,
    render,
)
from instar.tasks.tiny_model import CHAT_TEMPLATE, VL_CHAT_TEMPLATE
from instar.tasks.tools import CALCULATOR, LOOKUP

# Qwen3's way with reasoning (written here): an assistant turn shows its reasoning only after
# the last user query, the last one always (empty if it has none), and the generation prompt
# of a turn without thinking is an empty think block. Not local: it falls back.
QWEN3 = """\
{%- if tools %}<|im_start|>system
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- set ns = namespace(last=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}\
{% endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if loop.index0 > ns.last and (loop.last or m.reasoning_content) %}<think>
{{ m.reasoning_content or '' }}
</think>

{% endif %}{{ m.content }}
{%- for c in m.tool_calls or [] %}<tool_call>{"name": {{ c.name | tojson }}, "arguments": \
{{ c.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if not enable_thinking | default(true) %}<think>

</think>

{% endif %}{% endif %}"""

# The built-in template with a closing text after a conversation without generation prompt:
# one no message's text starts with (the whole conversation is rendered then), one that
# every message's text starts with (the new text is put in its place).
CLOSED = CHAT_TEMPLATE + "{%- if not add_generation_prompt %}<|endoftext|>{% endif %}"
OPENED = CHAT_TEMPLATE + "{%- if not add_generation_prompt %}<|im_start|>{% endif %}"

# Real families' ways, written here. Llama 3.1/3.2: a tool call is read as `tool_call.function`
# (name, arguments), tools go in the system turn, a tool result is ipython's; each turn ends
# with <|eot_id|>.
LLAMA31 = """\
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{% set f = c.function %}<|python_tag|>{"name": "{{ f.name }}", \
"parameters": {{ f.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- elif m.role != 'system' %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Qwen2.5: an assistant turn's text only `if message.content`; a call's `function` if it has
# one; consecutive tool results in one user turn (so not local: it reads the neighbours).
QWEN25 = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{%- for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{%- if m.content %}{{ '\\n' + m.content }}{% endif %}
{%- for c in m.tool_calls %}{% if c.function is defined %}{% set c = c.function %}{% endif %}
{{- '\\n<tool_call>\\n{"name": "' + c.name + '", "arguments": ' + c.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}<|im_end|>{{ '\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Phi-3.5: a conversation without generation prompt ends with one more eos_token (<|end|>).
PHI35 = """\
{%- for m in messages %}
{%- if m.role == 'system' and m.content %}<|system|>
{{ m.content }}<|end|>
{% elif m.role in ('user', 'tool') %}<|user|>
{{ m.content }}<|end|>
{% elif m.role == 'assistant' %}<|assistant|>
{{ m.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% else %}{{ eos_token }}{% endif %}"""

# GLM: no end-of-turn token; the model stops at the next message's header (<|user|>,
# <|observation|>), which a tokenizer may name as its eos_token.
GLM = """\
[gMASK]<sop>
{%- if tools %}<|system|>
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|assistant|>
{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.name }}
{{ c.function.arguments | tojson }}{% endfor %}
{%- elif m.role == 'tool' %}<|observation|>
{{ m.content }}
{%- else %}<|{{ m.role }}|>
{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

STYLES = {  # template, added special tokens, eos_token
    "llama3.1": (LLAMA31, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                            "<|python_tag|>"], "<|eot_id|>"),
    "qwen2.5": (QWEN25, [], None),
    "phi3.5": (PHI35, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|end|>"),
    "glm": (GLM, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|observation|>"], "<|user|>"),
}

LOCAL = {"builtin": CHAT_TEMPLATE, "vl": VL_CHAT_TEMPLATE, "closed": CLOSED, "opened": OPENED,
         **{name: f["template"] for name, f in FAMILIES.items()},
         **{name: STYLES[name][0] for name in ("llama3.1", "phi3.5", "glm")}}
NOT_LOCAL = {
    "qwen3": QWEN3,
    "qwen2.5": QWEN25,
    "loop.last": CHAT_TEMPLATE.replace("{%- if not (loop.first and sys) -%}",
                                       "{%- if not (loop.first and sys) and not loop.last -%}"),
    "another message": CHAT_TEMPLATE.replace("{{ m.role }}\n", "{{ messages[-1].role }}\n"),
    "a copy of messages": "{% set ms = messages %}" + CHAT_TEMPLATE,
    "messages counted": CHAT_TEMPLATE.replace("{{ m.role }}\n", "{{ messages | length }}\n"),
    "two loops": CHAT_TEMPLATE + "{% for m in messages %}{{ m.role }}{% endfor %}",
    "state between turns": "{% set ns = namespace(n=0) %}" + CHAT_TEMPLATE.replace(
        "{{ m.role }}\n", "{{ m.role }}{% set ns.n = ns.n + 1 %}{{ ns.n }}\n"),
    "a joiner": "{% set sep = joiner('|') %}" + CHAT_TEMPLATE.replace(
        "{{ m.role }}\n", "{{ m.role }}{{ sep() }}\n"),
    "the time": CHAT_TEMPLATE.replace("{{ m.role }}\n", "{{ strftime_now('%Y') }}\n"),
    "break": CHAT_TEMPLATE.replace("{%- endif -%}\n{%- endfor -%}",
                                   "{%- endif -%}{% if m.role == 'tool' %}{% break %}{% endif %}"
                                   "\n{%- endfor -%}"),
    "generation prompt in the loop": CHAT_TEMPLATE.replace(
        "{{ m.role }}\n", "{{ m.role }}{{ add_generation_prompt }}\n"),
    "generation prompt in a macro": CHAT_TEMPLATE.replace(
        "{{ content }}", "{{ content }}{{ add_generation_prompt }}", 1),
    "a tag this parser does not know": "{% generation %}x{% endgeneration %}" + CHAT_TEMPLATE,
}
# text holding the template's own tokens' strings (rendered literally, and never fast)
LITERAL = ["<|im_end|>", "<tool_call>", "<|im_start|>user", "</think>", "[INST]", "<|eot_id|>"]
WORDS = "the a tool call result answer add sum number think step value reply please".split()


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    out = {}
    for name, template in {**LOCAL, **NOT_LOCAL}.items():
        if name in FAMILIES:
            out[name] = family_tokenizer(tiny_model, name)
        elif name in STYLES:
            out[name] = style_tokenizer(tiny_model, name)
        else:
            out[name] = AutoTokenizer.from_pretrained(tiny_model)
            out[name].add_tokens(["<think>", "</think>"] if name == "qwen3" else [])
            out[name].chat_template = template
    return out


def style_tokenizer(tiny_model, name: str, eos: str | None = None):
    """The built-in tokenizer with a STYLES template, its tokens and eos_token (or `eos`)."""
    template, special, default = STYLES[name]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_tokens(special, special_tokens=True)
    if eos or default:
        tok.eos_token = eos or default
    tok.chat_template = template
    return tok


def text(rng: random.Random, literal: bool) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, 6))]
    if literal and rng.random() < 0.15:
        words.insert(rng.randint(0, len(words)), rng.choice(LITERAL))
    return " ".join(words)


def conversation(rng: random.Random, literal: bool):
    """A seeded episode: the first messages, then per turn the reply and the new messages."""
    start = [{"role": "system", "content": text(rng, literal)}] if rng.random() < 0.5 else []
    start.append({"role": "user", "content": text(rng, literal) or "hi"})
    turns = []
    for _ in range(rng.randint(1, 7)):
        reply = {"role": "assistant", "content": text(rng, literal)}
        if rng.random() < 0.4:
            reply["reasoning_content"] = text(rng, literal)
        calls = [{"name": "calculator", "arguments": {"expression": f"{rng.randint(0, 99)}+1"}}
                 for _ in range(rng.choice([0, 0, 1, 2]))]
        if calls:  # (as the gateway keeps them)
            reply["tool_calls"] = canonical({"role": "assistant", "tool_calls": calls})[
                "tool_calls"]
        new = [{"role": "tool", "content": text(rng, literal)} for _ in calls] or [
            {"role": "user", "content": text(rng, literal)}]
        if rng.random() < 0.2:  # two new messages in one turn
            new.append({"role": "user", "content": text(rng, literal)})
        turns.append((reply, new))
    return start, turns


def outcome(f, *args):
    """What `f` returns, or the error it raises (the same ones, on both ways)."""
    try:
        return f(*args)
    except ValueError as e:
        return repr(e)


@pytest.mark.parametrize("name", list(LOCAL) + list(NOT_LOCAL))
def test_continuation_gives_the_ids_of_rendering_it_all_twice(tokenizers, name):
    tok, rng = tokenizers[name], random.Random(name)
    fast = compared = rewritten = 0
    for n in range(60):
        start, turns = conversation(rng, literal=n % 3 == 0)
        tools = [[CALCULATOR], [CALCULATOR, LOOKUP], None][n % 3]
        history, kept = list(start), None
        for reply, new in turns:
            before, eos = history + [reply], rng.random() < 0.8  # a stop without eos, too
            after = before + new
            want = outcome(continuation_ids, tok, before, after, tools, eos)
            got = outcome(continuation, tok, before, after, tools, eos, kept)
            got, kept = (got, None) if isinstance(got, str) else got
            assert got == want, (name, n, before, new, eos)
            compared += 1
            fast += kept is not None
            rewritten += want is None
            history = after
    assert compared > 150
    if name in LOCAL:  # plain conversations (two in three) took the fast way
        assert _local(tok.chat_template) and fast > compared / 2, fast
    else:
        assert not _local(tok.chat_template) and fast == 0
    if name == "qwen3":  # its rewrites (reasoning dropped, `loop.last`) were met and kept
        assert rewritten > 20


class Count:
    """How many messages each render of the tokenizer's template holds."""

    def __init__(self, monkeypatch, tok):
        self.sizes, render = [], type(tok).apply_chat_template

        def counted(this, messages, *args, **kwargs):
            self.sizes.append(len(messages))
            return render(this, messages, *args, **kwargs)
        monkeypatch.setattr(type(tok), "apply_chat_template", counted)

    def turn(self) -> list[int]:
        sizes, self.sizes = self.sizes, []
        return sizes


def test_only_a_segments_first_continued_turn_renders_the_conversation(tokenizers, monkeypatch):
    rng = random.Random(0)
    start = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "go"}]
    turns = [({"role": "assistant", "content": text(rng, False), "reasoning_content": "hm",
               "tool_calls": [{"name": "calculator", "arguments": {"expression": "1+1"}}]},
              [{"role": "tool", "content": "2"}]) for _ in range(30)]
    for name, fast in (("builtin", True), ("qwen3", False)):
        tok = tokenizers[name]
        count, history, kept = Count(monkeypatch, tok), list(start), None
        for t, (reply, new) in enumerate(turns):
            before, after = history + [reply], history + [reply] + new
            ids, kept = continuation(tok, before, after, [CALCULATOR], True, kept)
            sizes = count.turn()
            assert ids, (name, t)
            if not fast:  # the reply's prompt, the conversation as it was and as it is
                assert sorted(sizes) == [len(before) - 1, len(before), len(after)]
            elif t == 0:  # the reply's prompt and the conversation; the first message alone
                # and with the new message
                assert sorted(sizes) == [1, 1 + len(new), len(before) - 1, len(before)]
            else:  # the first message with the last turn's new messages and reply, then this
                assert sorted(sizes) == [1 + len(new), 1 + len(new) + 1], sizes
            history = after
        monkeypatch.undo()


CALLS = [{"type": "function", "function": {"name": "calculator",
                                           "arguments": '{"expression": "2+3"}'}}]
TOOL_TURNS = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "go"},
              {"role": "assistant", "content": "", "tool_calls": CALLS},
              {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."},
              {"role": "user", "content": "thanks"}]


def test_tool_calls_render_as_templates_read_them(tokenizers):
    """`canonical` keeps a call in both shapes: templates that read `{name, arguments}` render
    it as before, byte for byte, and Llama-3.1- or GLM-style ones that read `function` render
    it at all (with the flat shape alone they raised)."""
    kept = [canonical(m) for m in TOOL_TURNS]
    flat = [{**m, "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+3"}}]}
            if "tool_calls" in m else m for m in kept]
    assert kept[2]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "2+3"},
                                      "type": "function", "function": flat[2]["tool_calls"][0]}]
    for name, tok in tokenizers.items():
        if name in ("llama3.1", "glm"):
            with pytest.raises(Exception, match="function"):
                render(tok, flat, [CALCULATOR], True)
            assert '"expression": "2+3"' in render(tok, kept, [CALCULATOR], True), name
        else:
            assert render(tok, kept, [CALCULATOR], True) == render(tok, flat, [CALCULATOR], True)
    llama = tokenizers["llama3.1"]
    assert continuation_ids(llama, kept[:3], kept[:4], [CALCULATOR], True) == encode(
        llama, "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_empty_text_is_not_marked(tokenizers):
    """With some message holding a control token's string, every text is rendered marked; an
    empty one stays empty, so Qwen2.5's `if message.content` still skips it (marked, the
    template wrote a newline and a marked-empty text, and `render` refused: "rewrites message
    text"). The typed <|im_end|> stays text."""
    assert _marked([{"role": "assistant", "content": "", "reasoning_content": ""}]) == [
        {"role": "assistant", "content": "", "reasoning_content": ""}]
    tok = tokenizers["qwen2.5"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for typed in ("<|im_end|>", "im_end"):  # (the second holds no control token's string)
        msgs = [canonical(m) for m in TOOL_TURNS]
        msgs[1] = {"role": "user", "content": f"go {typed}"}
        ids = prompt_ids(tok, msgs, [CALCULATOR])
        assert tok.decode(ids) == render(tok, msgs, [CALCULATOR], True)
        assert ids.count(end) == 6  # (the template's: 5 messages and the tool list)
        assert "<|im_start|>assistant\n<tool_call>" in tok.decode(ids)  # (no empty text)
        ids = continuation_ids(tok, msgs[:3], msgs[:4], [CALCULATOR], True)
        assert tok.decode(ids) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>" \
                                  "<|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_ends_at_its_own_eos_token(tiny_model, tokenizers):
    """The ids of a continued turn come after the eos_token that ends the reply's own turn:
    - Phi-3.5 closes a conversation without generation prompt with one more eos_token (the
      last one of that render); the turn still continues, with or without the eos sampled,
      and the episode's ids are those of rendering it whole;
    - where the turn holds no eos_token, the continuation is refused (None): GLM's turns end
      at the next message's header, and a Phi-3.5 tokenizer whose eos_token is
      <|endoftext|> ends them with another token (before, each got ids: GLM's repeated the
      earlier turns, Phi's lacked the newline after <|end|>)."""
    phi = tokenizers["phi3.5"]
    msgs = TOOL_TURNS[:2] + [{"role": "assistant", "content": "It is 5."},
                             {"role": "user", "content": "and 3+4?"}]
    reply = encode(phi, "It is 5.")
    for stopped_at_eos in (True, False):
        ids = prompt_ids(phi, msgs[:2], None) + reply + [phi.eos_token_id] * stopped_at_eos
        more = continuation_ids(phi, msgs[:3], msgs, None, stopped_at_eos)
        assert ids + more == prompt_ids(phi, msgs, None)
        assert continuation(phi, msgs[:3], msgs, None, stopped_at_eos, None)[0] == more
    for name, eos in (("glm", None), ("phi3.5", "<|endoftext|>")):
        tok = style_tokenizer(tiny_model, name, eos)
        assert tok.eos_token in render(tok, msgs[:3], None, False)
        for stopped_at_eos in (True, False):
            assert continuation_ids(tok, msgs[:3], msgs, None, stopped_at_eos) is None
            assert continuation(tok, msgs[:3], msgs, None, stopped_at_eos, None)[0] is None
