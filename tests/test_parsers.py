"""Tool calls and reasoning of three model families (Hermes/Qwen, Llama-3 JSON, Mistral), by
vLLM's parsers (instar/rollout/parsers.py), on the built-in tokenizer given each family's
chat template and tokens (short templates written here).

Detection is fast; the rest loads vLLM's parsers (some seconds, no engine: `stack`). The
engine's part is a scripted one that samples a fixed text and parses it as `Engine.generate`
does; the real engine's parse is exercised by tests/test_gateway.py and tests/test_tool_use.py.
"""

import asyncio

import anthropic
import openai
import pytest
from transformers import AutoTokenizer

from instar.agents.chat import encode, render
from instar.agents.contract import Env, Result, Task
from instar.agents.env_loop import run_env_episode
from instar.gateway.server import Gateway
from instar.rollout.engine import Generation
from instar.rollout.parsers import check, detect
from instar.tasks.tiny_model import CHAT_TEMPLATE

QWEN = """\
{%- if tools %}<|im_start|>system
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}
{%- for c in m.tool_calls or [] %}<tool_call>{"name": {{ c.name | tojson }}, "arguments": \
{{ c.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA = """\
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
{% for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}\
<|end_header_id|>

{% for c in m.tool_calls or [] %}<|python_tag|>{"name": {{ c.name | tojson }}, "parameters": \
{{ c.arguments | tojson }}}{% else %}{{ m.content }}{% endfor %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{% if m.reasoning_content %}[THINK]{{ m.reasoning_content }}\
[/THINK]{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.name }}[ARGS]\
{{ c.arguments | tojson }}{% endfor %}</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}[INST]{{ m.content }}[/INST]
{%- endif %}
{%- endfor %}"""

# family: template, tokens it adds (special or not, as the family's own tokenizer has them),
# end-of-turn token, the parsers detected, a turn with reasoning and a call, and its parts
FAMILIES = {
    "qwen": dict(template=QWEN, tokens=["<think>", "</think>"], special=[], eos=None,
                 parsers=("hermes", "qwen3"),
                 call='<think>2 and 3 make 5</think>Let me add.<tool_call>{"name": "add", '
                      '"arguments": {"a": 2, "b": 3}}</tool_call>',
                 reasoning="2 and 3 make 5", content="Let me add.",
                 answer="<think>the tool said 5</think>The sum is 5."),
    "llama": dict(template=LLAMA, tokens=[], eos="<|eot_id|>", parsers=("llama3_json", "none"),
                  special=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                           "<|python_tag|>"],
                  call='<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
                  reasoning=None, content="", answer="The sum is 5."),
    "mistral": dict(template=MISTRAL, tokens=[], eos="</s>", parsers=("mistral", "mistral"),
                    special=["</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]",
                             "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]",
                             "[/AVAILABLE_TOOLS]", "[THINK]", "[/THINK]"],
                    call='[THINK]2 and 3 make 5[/THINK]Let me add.[TOOL_CALLS]add[ARGS]'
                         '{"a": 2, "b": 3}',
                    reasoning="2 and 3 make 5", content="Let me add.",
                    answer="[THINK]the tool said 5[/THINK]The sum is 5."),
}
ADD = {"type": "function", "function": {"name": "add", "description": "",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "number"}, "b": {"type": "number"}}}}}
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


def family_tokenizer(tiny_model, name: str):
    f = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_tokens(f["tokens"])
    tok.add_tokens(f["special"], special_tokens=True)
    if f["eos"]:
        tok.eos_token = f["eos"]
    tok.chat_template = f["template"]
    return tok


def test_parsers_are_detected_from_the_chat_template(tiny_model):
    for name, f in FAMILIES.items():
        tok = family_tokenizer(tiny_model, name)
        assert detect(tok.chat_template, tok.get_vocab()) == f["parsers"], name
    builtin = family_tokenizer(tiny_model, "qwen").get_vocab()
    assert detect(CHAT_TEMPLATE, builtin) == ("hermes", "none")
    assert detect("{{ '<|python_tag|>' }}", builtin) == ("hermes", "none")  # (not a token)
    assert detect(None, {}) == ("hermes", "none")


# -- below: vLLM's parsers -------------------------------------------------------------------

def parsers_for(tok):
    from instar.rollout.parsers import Parsers

    return Parsers(tok)


@pytest.mark.stack
def test_unknown_parser_names_are_refused_naming_the_flag_and_the_known_ones():
    check("", "none")  # (nothing to check: nothing imported)
    with pytest.raises(ValueError, match=r"--model\.tool-parser 'hermez'.*hermes.*llama3_json"):
        check("hermez", "")
    with pytest.raises(ValueError, match=r"--model\.reasoning-parser 'qwen9'.*deepseek_r1"):
        check("hermes", "qwen9")


@pytest.mark.stack
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_familys_calls_and_reasoning_are_parsed(tiny_model, name):
    f, tok = FAMILIES[name], family_tokenizer(tiny_model, name)
    parsers = parsers_for(tok)
    assert parsers.names == f["parsers"]
    parsed = parsers.parse(f["call"])
    assert (parsed.tool_calls, parsed.reasoning, parsed.content, parsed.tool_call_errors) == \
        ([CALL], f["reasoning"], f["content"], 0)
    plain = parsers.parse("The sum is 5.")  # no markers: no reasoning, no call
    assert (plain.tool_calls, plain.reasoning, plain.content) == ([], None, "The sum is 5.")
    broken = f["call"].replace('{"a": 2', '{"a": 2,,')  # a call begun that does not parse
    bad = parsers.parse(broken)
    assert (bad.tool_calls, bad.tool_call_errors, bad.reasoning) == ([], 1, f["reasoning"])


COMPLETIONS = ['Let me add.<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>',
               'Let me add. [TOOL_CALLS]add[ARGS]{"a": 2}', "Let me <function=add>\n"
               "<parameter=a>\n2\n</parameter>\n</function>", '  Sure. <tool_call>{"name": '
               '"add", "arguments": {}}</tool_call>', "A <tool_ca is no call.  ", "The sum is 5.",
               '<tool_call>{"name": "add", "arguments": {"a": 2,,}}</tool_call>',
               'Hi {"name": "add", "parameters": {"a": 2}}']


@pytest.mark.stack
@pytest.mark.parametrize("family,tool,reasoning", [
    ("qwen", "hermes", "none"), ("qwen", "qwen3_coder", "none"), ("mistral", "mistral", "none"),
    ("llama", "llama3_json", "none"), ("qwen", "hermes", "qwen3"), ("qwen", "none", "none")])
def test_settled_text_is_the_start_of_the_reply_however_the_completion_goes_on(
        tiny_model, family, tool, reasoning):
    """What a stream shows before the completion ends, at every character of it: never
    shrinks, and begins the reply of the whole completion (its parsed content, and its text,
    which a request that parses no calls gets); text comes live where the parser allows."""
    from instar.rollout.parsers import Parsers

    parsers = Parsers(family_tokenizer(tiny_model, family), tool, reasoning)
    for text in COMPLETIONS:
        reply, shown = parsers.parse(text).content, ""
        for end in range(len(text) + 1):
            settled = parsers.settled(text[:end])
            assert settled.startswith(shown) and reply.startswith(settled) and \
                text.startswith(settled), (text[:end], settled)
            shown = settled
    live = reasoning == "none" and tool != "llama3_json"  # (which reads a call at any "{")
    assert parsers.settled("Let me add.") == ("Let me add." if live else "")


@pytest.mark.stack
def test_a_parser_that_cannot_read_this_tokenizer_names_its_flag(tiny_model):
    from instar.rollout.parsers import Parsers

    with pytest.raises(ValueError, match=r"--model\.tool-parser llama3_json cannot parse"):
        Parsers(family_tokenizer(tiny_model, "qwen"), "llama3_json", "none")


class ScriptedEngine:
    """Samples the scripted texts in turn (their ids, then the end-of-turn token) and parses
    each as `Engine.generate` does; keeps the prompts it was given."""

    def __init__(self, tok, texts: list[str]):
        self.tok, self.texts, self.prompts = tok, list(texts), []
        self.parsers, self.sampled = parsers_for(tok), []

    def __call__(self, *args):  # (gateway: episode, ids, sampling, images; Env: ids, ...)
        ids = args[1] if isinstance(args[0], str) else args[0]
        self.prompts.append(list(ids))
        out = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        text = self.tok.decode(out[:-1], skip_special_tokens=False)  # (as vLLM's text)
        p = self.parsers.parse(text)
        self.sampled.append(out)

        async def gen():
            return Generation(out, [-0.5] * len(out), [0] * len(out), "stop", text,
                              reasoning=p.reasoning, content=p.content, tool_calls=p.tool_calls,
                              tool_call_errors=p.tool_call_errors)
        return gen()


def whole(tok, conversation, tools) -> list[int]:
    """The conversation's ids as the template renders it whole, to its last end of turn."""
    text = render(tok, conversation, tools, False)
    return encode(tok, text[:text.rindex(tok.eos_token) + len(tok.eos_token)])


def conversation(f) -> list[dict]:
    """The episode the scripted engine plays, as the template renders it."""
    answer = f["answer"].split("[/THINK]")[-1].split("</think>")[-1]
    first = {"role": "assistant", "content": f["content"], "tool_calls": [CALL]}
    last = {"role": "assistant", "content": answer}
    if f["reasoning"]:
        first["reasoning_content"], last["reasoning_content"] = f["reasoning"], "the tool said 5"
    return QUESTION + [first, {"role": "tool", "content": "5"}, last]


def openai_turn(client, messages, stream: bool) -> dict:
    """One request; the assistant message as a client sends it back (reasoning included)."""
    if not stream:
        return client.chat.completions.create(model="m", messages=messages, tools=[ADD]) \
            .choices[0].message.model_dump(exclude_none=True)
    msg, calls = {"role": "assistant", "content": ""}, []
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=[ADD],
                                                stream=True):
        delta = chunk.choices[0].delta
        msg["content"] += delta.content or ""
        if (delta.model_extra or {}).get("reasoning_content"):
            msg["reasoning_content"] = delta.model_extra["reasoning_content"]
        calls += [c.model_dump(exclude_none=True) for c in delta.tool_calls or []]
    return {**msg, **({"tool_calls": calls} if calls else {})}


def anthropic_turn(client, messages, stream: bool) -> dict:
    kw = dict(model="m", max_tokens=64, messages=messages, tools=[
        {"name": "add", "input_schema": ADD["function"]["parameters"]}])
    if stream:
        with client.messages.stream(**kw) as s:
            reply = s.get_final_message()
    else:
        reply = client.messages.create(**kw)
    return {"role": "assistant", "content": [b.model_dump() for b in reply.content]}


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire", ["openai", "anthropic"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_calls_and_reasoning_round_trip_token_exact_on_both_wires(tiny_model, name, wire,
                                                                    stream):
    """A call with reasoning, the tool's result, an answer with reasoning: the client sends
    each reply back as it got it; one segment, whose sampled spans are the engine's ids and
    whose whole is the template's rendering of the conversation."""
    f, tok = FAMILIES[name], family_tokenizer(tiny_model, name)
    engine = ScriptedEngine(tok, [f["call"], f["answer"]])
    gw = Gateway(engine, tok, model="m", max_model_len=512).start()
    try:
        sid = gw.open_session("r0", "g0", {"temperature": 1.0, "max_tokens": 64}, 8, 512)
        openai_url, anthropic_url = gw.urls(sid)
        messages = list(QUESTION)
        if wire == "openai":
            client = openai.OpenAI(base_url=openai_url, api_key=gw.api_key, max_retries=0)
            first = openai_turn(client, messages, stream)
            assert first.get("reasoning_content") == f["reasoning"]
            (call,) = first["tool_calls"]
            assert (call["function"]["name"], call["function"]["arguments"]) == \
                ("add", '{"a": 2, "b": 3}')
            messages += [first, {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
            last = openai_turn(client, messages, stream)
        else:
            client = anthropic.Anthropic(base_url=anthropic_url, api_key=gw.api_key,
                                         max_retries=0)
            first = anthropic_turn(client, messages, stream)
            kinds = [b["type"] for b in first["content"]]
            thinking = [b for b in first["content"] if b["type"] == "thinking"]
            assert [b["thinking"] for b in thinking] == ([f["reasoning"]] if f["reasoning"] else [])
            assert all(b["signature"] == "" for b in thinking)
            (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
            assert (use["name"], use["input"]) == ("add", {"a": 2, "b": 3})
            assert kinds == ["thinking"] * bool(f["reasoning"]) + ["text"] * bool(f["content"]) + [
                "tool_use"]
            messages += [first, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use["id"], "content": "5"}]}]
            last = anthropic_turn(client, messages, stream)
        assert "The sum is 5." in str(last)
        session = gw.close_session(sid)
    finally:
        gw.stop()
    (seg,) = session.segments
    trained = [t for t, m in zip(seg.tokens, seg.loss_mask) if m]
    assert trained == engine.sampled[0] + engine.sampled[1]  # as sampled
    assert seg.tokens == whole(tok, conversation(f), [ADD])
    assert engine.prompts[1] == seg.tokens[:len(engine.prompts[1])]


@pytest.mark.stack
def test_a_client_that_drops_the_reasoning_starts_a_new_segment(tiny_model):
    f, tok = FAMILIES["qwen"], family_tokenizer(tiny_model, "qwen")
    engine = ScriptedEngine(tok, [f["call"], f["answer"]])
    gw = Gateway(engine, tok, model="m", max_model_len=512).start()
    try:
        sid = gw.open_session("r0", "g0", {"temperature": 1.0, "max_tokens": 64}, 8, 512)
        client = openai.OpenAI(base_url=gw.urls(sid)[0], api_key=gw.api_key, max_retries=0)
        first = openai_turn(client, list(QUESTION), False)
        del first["reasoning_content"]
        openai_turn(client, QUESTION + [first, {"role": "tool", "tool_call_id": "c",
                                                "content": "5"}], False)
        session = gw.close_session(sid)
    finally:
        gw.stop()
    assert [s.sealed_because for s in session.segments] == ["history_rewritten", ""]
    assert "<think>" not in tok.decode(session.segments[1].tokens[:len(engine.prompts[1])])


class Adds(Env):
    tools, max_turns = [ADD], 3

    async def reset(self, task):
        self.actions = []
        return task.prompt

    async def step(self, action):
        self.actions.append(action)
        if action.tool_calls:
            return Result(0.0, [{"role": "tool", "content": "5"}], terminated=False)
        return Result(float(action.content == "The sum is 5."))


class OwnParse(Adds):
    def parse_tool_calls(self, text):
        return [{"name": "own", "arguments": {"text": text}}] if "add" in text else []


def episode(env: Env, tok, texts: list[str]):
    return asyncio.run(run_env_episode(env, Task(QUESTION), ScriptedEngine(tok, texts), tok,
                                       {"max_tokens": 64}, "r0", "g0"))


@pytest.mark.stack
@pytest.mark.parametrize("name", list(FAMILIES))
def test_env_actions_carry_the_engines_parse_and_the_sample_is_token_exact(tiny_model, name):
    f, tok = FAMILIES[name], family_tokenizer(tiny_model, name)
    env = Adds()
    sample = episode(env, tok, [f["call"], f["answer"]])
    first, last = env.actions
    assert (first.tool_calls, first.reasoning, first.content, first.text) == \
        ([CALL], f["reasoning"], f["content"], f["call"])
    assert last.reasoning == ("the tool said 5" if f["reasoning"] else None)
    assert sample.reward == 1.0 and sample.info["tool_call_errors"] == 0
    assert sample.tokens == whole(tok, conversation(f), [ADD])
    own = OwnParse()  # an Env's own parse wins over the engine's
    episode(own, tok, [f["call"], f["answer"]])
    assert own.actions[0].tool_calls == [{"name": "own", "arguments": {"text": f["call"]}}]
