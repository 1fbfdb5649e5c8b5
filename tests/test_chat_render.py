"""Rendering only what is new (instar/agents/chat.py `continuation`): the same ids as
`continuation_ids`, which renders the whole conversation twice, on many seeded conversations
and several templates (the built-in ones, three model families', a Qwen3-style template that
rewrites history, and closing texts that get in the way); which templates count as rendering
each message on its own; and how much is rendered per turn. Tokenizer only, no engine."""

import random

import pytest
from test_parsers import FAMILIES, family_tokenizer
from transformers import AutoTokenizer

from instar.agents.chat import _local, continuation, continuation_ids
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

LOCAL = {"builtin": CHAT_TEMPLATE, "vl": VL_CHAT_TEMPLATE, "closed": CLOSED, "opened": OPENED,
         **{name: f["template"] for name, f in FAMILIES.items()}}
NOT_LOCAL = {
    "qwen3": QWEN3,
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
            continue
        tok = AutoTokenizer.from_pretrained(tiny_model)
        tok.add_tokens(["<think>", "</think>"] if name == "qwen3" else [])
        tok.chat_template = template
        out[name] = tok
    return out


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
        if calls:
            reply["tool_calls"] = calls
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


def test_a_continued_turn_renders_the_conversation_at_most_once(tokenizers, monkeypatch):
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
            if not fast:  # the whole conversation, as it was and as it is
                assert sorted(sizes) == [len(before), len(after)]
            elif t == 0:  # once, with the first message alone and with the new message
                assert sorted(sizes) == [1, 1 + len(new), len(before)]
            else:  # the first message with the last turn's new messages and reply, then this
                assert sorted(sizes) == [1 + len(new), 1 + len(new) + 1], sizes
            history = after
        monkeypatch.undo()
