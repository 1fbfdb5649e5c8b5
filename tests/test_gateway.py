"""The gateway over HTTP with the official OpenAI (chat completions, Responses) and Anthropic
SDKs, on the real engine.

`tool_engine` serves the tiny model taught to call the calculator (see conftest), so tool calls in
these conversations are real generations.
"""

import json
import time

import anthropic
import httpx
import openai
import pytest
import ray
from conftest import CALCULATOR, TOOL_CONVERSATION

from instar.agents.chat import render
from instar.gateway.server import Gateway
from instar.rollout.router import Router
from instar.rollout.versions import Versions

pytestmark = pytest.mark.stack

SAMPLING = {"temperature": 0.3, "max_tokens": 40}  # low: the taught path, reliably
ANTHROPIC_TOOL = {"name": "calculator", "description": "Evaluate an arithmetic expression",
                  "input_schema": CALCULATOR["function"]["parameters"]}


class Recorder:
    """Calls the real engine and keeps what it returned, turn by turn."""

    def __init__(self, engine):
        self.engine, self.outputs = engine, []

    async def __call__(self, episode, ids, sampling, images):
        gen = await self.engine.generate.remote(ids, sampling, 0, images)
        self.outputs.append(gen)
        return gen


@pytest.fixture
def gateway(tool_engine, tokenizer):
    recorder = Recorder(tool_engine)
    gw = Gateway(recorder, tokenizer, model="tiny", max_model_len=512).start()
    gw.recorder = recorder
    yield gw
    gw.stop()


def session(gw, max_turns=8, max_tokens=4096):
    sid = gw.open_session("r0", "g0", SAMPLING, max_turns, max_tokens)
    return sid, *gw.urls(sid)


def generated_spans(segment):
    spans, cur = [], []
    for tok, m in zip(segment.tokens, segment.loss_mask):
        if m:
            cur.append(tok)
        elif cur:
            spans, cur = spans + [cur], []
    return spans + ([cur] if cur else [])


def assert_token_identity(gw, seg, messages, tools):
    """Generated spans are the engine's outputs, in order; everything else is the template's
    rendering of the conversation (assistant turns = the engine's own text)."""
    outs = gw.recorder.outputs
    assert generated_spans(seg) == [g.token_ids for g in outs]
    assert [lp for lp in seg.logprobs if lp is not None] == [x for g in outs for x in g.logprobs]
    convo, k = [], 0
    for m in messages:
        if m["role"] == "assistant":
            m = {"role": "assistant", "content": outs[k].text}
            k += 1
        convo.append(m)
    convo.append({"role": "assistant", "content": outs[-1].text})
    text = gw.tokenizer.decode(seg.tokens, skip_special_tokens=False)
    expected = render(gw.tokenizer, convo, tools, False)
    if outs[-1].finish_reason == "length":  # the last turn has no end-of-turn token yet
        expected = expected[:expected.rindex("<|im_end|>")]
    assert text == expected.removesuffix("\n")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_round_trip_is_one_token_exact_segment(gateway, stream):
    sid, base, _ = session(gateway)
    client = openai.OpenAI(base_url=base, api_key=gateway.api_key)
    messages = [{"role": "user", "content": "What is 2+3?"}]

    def ask():
        if not stream:
            return client.chat.completions.create(model="tiny", messages=messages,
                                                  tools=[CALCULATOR]).choices[0]
        chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                     tools=[CALCULATOR], stream=True))
        calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or []) if ch.choices]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        return finish, calls

    if stream:
        finish, calls = ask()
        assert finish == "tool_calls"
        call = {"id": calls[0].id, "type": "function",
                "function": {"name": calls[0].function.name,
                             "arguments": calls[0].function.arguments}}
    else:
        choice = ask()
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0].model_dump()
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "2+3"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    ask()
    captured = gateway.close_session(sid)
    assert len(captured.segments) == 1 and captured.turns == 2
    assert_token_identity(gateway, captured.segments[0], messages, [CALCULATOR])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_round_trip_is_one_token_exact_segment(gateway, stream):
    sid, _, base = session(gateway)
    client = anthropic.Anthropic(base_url=base, api_key=gateway.api_key)
    messages = [{"role": "user", "content": "What is 2+3?"}]

    def ask():
        kw = dict(model="tiny", max_tokens=40, messages=messages, tools=[ANTHROPIC_TOOL])
        if stream:
            with client.messages.stream(**kw) as s:
                return s.get_final_message()
        return client.messages.create(**kw)

    first = ask()
    assert first.stop_reason == "tool_use"
    use = [b for b in first.content if b.type == "tool_use"][0]
    assert (use.name, use.input) == ("calculator", {"expression": "2+3"})
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "5"}]}]
    ask()
    captured = gateway.close_session(sid)
    assert len(captured.segments) == 1 and captured.turns == 2
    convo = [messages[0], {"role": "assistant", "content": ""}, {"role": "tool", "content": "5"}]
    assert_token_identity(gateway, captured.segments[0], convo, [CALCULATOR])


RESPONSES_TOOL = {"type": "function", **CALCULATOR["function"]}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_round_trip_is_one_token_exact_segment(gateway, stream):
    """The stock SDK's `client.responses.create`; the agent sends its whole input each turn,
    the output items back as they came."""
    sid, base, _ = session(gateway)
    client = openai.OpenAI(base_url=base, api_key=gateway.api_key)
    items = [{"role": "user", "content": "What is 2+3?"}]

    def ask():
        kw = dict(model="tiny", input=items, tools=[RESPONSES_TOOL], store=False)
        if not stream:
            return client.responses.create(**kw)
        events = list(client.responses.create(**kw, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert kinds[-1] == "response.completed"
        return events[-1].response

    first = ask()
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("calculator", {"expression": "2+3"})
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"})
    second = ask()
    assert second.output_text == gateway.recorder.outputs[-1].text
    assert second.usage.output_tokens == len(gateway.recorder.outputs[-1].token_ids)
    captured = gateway.close_session(sid)
    assert len(captured.segments) == 1 and captured.turns == 2
    convo = [items[0], {"role": "assistant", "content": ""}, {"role": "tool", "content": "5"}]
    assert_token_identity(gateway, captured.segments[0], convo, [CALCULATOR])


def test_responses_previous_response_id_and_instructions(gateway):
    """A turn that sends only what is new continues the stored response; instructions are a
    system message before it; a response not stored cannot be continued."""
    sid, base, _ = session(gateway)
    client = openai.OpenAI(base_url=base, api_key=gateway.api_key, max_retries=0)
    rules = "Use the calculator."
    first = client.responses.create(model="tiny", instructions=rules, input="What is 2+3?",
                                    tools=[RESPONSES_TOOL])
    call = [o for o in first.output if o.type == "function_call"][0]
    second = client.responses.create(
        model="tiny", instructions=rules, previous_response_id=first.id, tools=[RESPONSES_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        store=False)
    assert second.previous_response_id == first.id and second.instructions == rules
    with pytest.raises(openai.BadRequestError, match="no stored response") as e:
        client.responses.create(model="tiny", previous_response_id=second.id, input="more?")
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError, match="unsupported input item"):
        client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "x"}])
    with pytest.raises(openai.BadRequestError, match="no built-in tools"):
        client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
    captured = gateway.close_session(sid)
    assert len(captured.segments) == 1 and captured.turns == 2
    convo = [{"role": "system", "content": rules}, {"role": "user", "content": "What is 2+3?"},
             {"role": "assistant", "content": ""}, {"role": "tool", "content": "5"}]
    assert_token_identity(gateway, captured.segments[0], convo, [CALCULATOR])


def test_models_are_listed_on_both_wires(gateway):
    sid, oa_base, an_base = session(gateway)
    models = openai.OpenAI(base_url=oa_base, api_key=gateway.api_key).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    models = anthropic.Anthropic(base_url=an_base, api_key=gateway.api_key).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=oa_base, api_key="wrong", max_retries=0).models.list()
    gateway.close_session(sid)


def test_compaction_seals_a_segment_with_the_reason(gateway):
    sid, base, _ = session(gateway)
    client = openai.OpenAI(base_url=base, api_key=gateway.api_key)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "and 4+4?"}]
    client.chat.completions.create(model="tiny", messages=messages)
    compacted = [{"role": "system", "content": "Earlier: 2+3 was asked."},
                 {"role": "user", "content": "and 4+4?"}]
    client.chat.completions.create(model="tiny", messages=compacted)
    captured = gateway.close_session(sid)
    assert [s.sealed_because for s in captured.segments] == ["history_rewritten", ""]
    samples = captured.samples(reward=0.5, info={})
    assert [s.segment for s in samples] == [0, 1]
    assert {s.rollout_id for s in samples} == {"r0"} and {s.reward for s in samples} == {0.5}
    assert samples[1].tokens[:sum(1 for m in samples[1].loss_mask if not m)] == \
        gateway.tokenizer.encode(render(gateway.tokenizer, compacted, None, True))


def test_a_retried_request_is_answered_again_but_recorded_once(gateway):
    sid, base, _ = session(gateway)
    client = openai.OpenAI(base_url=base, api_key=gateway.api_key)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    a = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR])
    b = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR])
    assert a.choices[0].message == b.choices[0].message
    assert gateway.sessions[sid].turns == 1 and len(gateway.recorder.outputs) == 1
    # the same messages with another max_tokens are another request: generated anew
    c = client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR],
                                       max_tokens=3)
    assert c.usage.completion_tokens <= 3
    captured = gateway.close_session(sid)
    assert captured.turns == 2 and len(gateway.recorder.outputs) == 2


def test_bad_input_gets_the_wire_error_shape_and_changes_nothing(gateway):
    sid, oa_base, an_base = session(gateway, max_turns=2)
    oa = openai.OpenAI(base_url=oa_base, api_key=gateway.api_key, max_retries=0)
    an = anthropic.Anthropic(base_url=an_base, api_key=gateway.api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    oa.chat.completions.create(model="tiny", messages=messages)
    before = gateway.sessions[sid].segments[0].tokens.copy()
    headers = {"Authorization": f"Bearer {gateway.api_key}", "x-api-key": gateway.api_key,
               "content-type": "application/json"}

    def raw(path, body, sid_=sid, hdrs=headers):
        return httpx.post(f"{gateway.base}/s/{sid_}/v1/{path}", content=body, headers=hdrs)

    cases = [
        (raw("chat/completions", b"{not json"), 400, "openai"),
        (raw("messages", b"{not json"), 400, "anthropic"),
        (raw("chat/completions", b"{}", sid_="nope"), 404, "openai"),
        (raw("messages", b'{"model": "m"}', sid_="nope"), 404, "anthropic"),
        (raw("chat/completions", b"{}", hdrs={"Authorization": "Bearer wrong"}), 401, "openai"),
        (raw("messages", b"{}", hdrs={"x-api-key": "wrong"}), 401, "anthropic"),
        (raw("messages", json.dumps({"model": "m", "messages": messages}).encode()), 400,
         "anthropic"),  # no max_tokens
        (raw("chat/completions", json.dumps({"messages": messages, "n": 2}).encode()), 400,
         "openai"),
        (raw("chat/completions", json.dumps({"messages": messages, "temperature": 0.9}).encode()),
         400, "openai"),
        (raw("messages", json.dumps({"messages": messages, "max_tokens": 5,
                                     "top_k": 5}).encode()), 400, "anthropic"),
        (raw("chat/completions", json.dumps({"messages": [
            {"role": "user", "content": "x" * 3000}]}).encode()), 400, "openai"),
        (raw("chat/completions", json.dumps({"messages": messages,
                                             "tool_choice": "required"}).encode()), 400, "openai"),
        (raw("messages", json.dumps({"messages": messages, "max_tokens": 5,
                                     "tool_choice": "auto", "tools": ["x"]}).encode()), 400,
         "anthropic"),  # fields of the wrong type
        (raw("chat/completions", json.dumps({"messages": {"role": "user"}}).encode()), 400,
         "openai"),
        (raw("chat/completions", json.dumps({"messages": [{"role": "user", "content": 7}]}
                                            ).encode()), 400, "openai"),
    ]
    for response, status, wire in cases:
        assert response.status_code == status, response.text
        body = response.json()
        if wire == "openai":
            assert set(body["error"]) >= {"message", "type"}, body
        else:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    long = httpx.post(f"{gateway.base}/s/{sid}/v1/chat/completions", headers=headers,
                      json={"messages": [{"role": "user", "content": "x" * 3000}]}).json()
    assert long["error"]["code"] == "context_length_exceeded"
    # the SDKs raise their own typed errors for these
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=oa_base, api_key="wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=messages)
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model="tiny", max_tokens=5, messages=messages,
                           extra_body={"temperature": 0.2})
    assert gateway.sessions[sid].segments[0].tokens == before and gateway.sessions[sid].turns == 1


def test_turn_limit_truncates_the_episode(gateway):
    sid, base, _ = session(gateway, max_turns=1)
    client = openai.OpenAI(base_url=base, api_key=gateway.api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    with pytest.raises(openai.BadRequestError, match="max_turns"):
        client.chat.completions.create(model="tiny", messages=messages)
    captured = gateway.close_session(sid)
    assert captured.truncated == "max_turns"
    assert [s.finish_reason for s in captured.samples(0.0, {})] == ["max_turns"]


def test_session_ids_and_binding(gateway):
    sids = {gateway.open_session(f"r{i}", "g", SAMPLING, 1, 100) for i in range(50)}
    assert len(sids) == 50 and all(len(s) >= 20 for s in sids)
    assert gateway.base.startswith("http://127.0.0.1:")
    assert ray.is_initialized()


# -- streamed as generated -------------------------------------------------------------------

class Routed:
    """The router over the engine, asked for whole generations or streamed ones; keeps what it
    returned."""

    def __init__(self, engine):
        self.router, self.outputs = Router([engine], Versions(), hang_s=0), []

    async def __call__(self, *args):  # (episode, ids, sampling, images[, on_text])
        gen = await self.router.generate(*args)
        self.outputs.append(gen)
        return gen


@pytest.fixture
def streaming(tool_engine, tokenizer):
    """A gateway that streams replies as the engine generates them, as a run's does."""
    routed = Routed(tool_engine)
    gw = Gateway(routed, tokenizer, model="tiny", max_model_len=512, stream=routed).start()
    gw.routed = routed
    yield gw
    gw.stop()


def tool_round_trip(gw, wire: str, stream: bool) -> list[dict]:
    """A call, its result, an answer, by the stock SDK of `wire`: each reply as the client
    got it (its text, calls, finish, text events), and the session's record."""
    sid = gw.open_session("r0", "g0", SAMPLING, 8, 4096)
    openai_url, anthropic_url = gw.urls(sid)
    replies, question = [], {"role": "user", "content": "What is 2+3?"}
    if wire == "openai":
        client, messages = openai.OpenAI(base_url=openai_url, api_key=gw.api_key), [question]
        for _ in range(2):
            kw = dict(model="tiny", messages=messages, tools=[CALCULATOR])
            if stream:
                chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True)]
                texts = [c.delta.content for c in chunks if c.delta.content]
                calls = [c.model_dump() for ch in chunks for c in ch.delta.tool_calls or []]
                finish = chunks[-1].finish_reason
            else:
                choice = client.chat.completions.create(**kw).choices[0]
                texts, finish = [choice.message.content or ""], choice.finish_reason
                calls = [c.model_dump() for c in choice.message.tool_calls or []]
            replies.append({"text": "".join(texts), "calls": [c["function"] for c in calls],
                            "finish": finish, "pieces": len(texts)})
            messages += [{"role": "assistant", "content": "".join(texts) or None,
                          **({"tool_calls": [{k: c[k] for k in ("id", "type", "function")}
                                             for c in calls]} if calls else {})},
                         {"role": "tool", "tool_call_id": calls[0]["id"] if calls else "", "content": "5"}]
    elif wire == "anthropic":
        client, messages = anthropic.Anthropic(base_url=anthropic_url, api_key=gw.api_key), [question]
        for _ in range(2):
            kw = dict(model="tiny", max_tokens=40, messages=messages, tools=[ANTHROPIC_TOOL])
            if stream:
                with client.messages.stream(**kw) as s:
                    pieces = sum(e.type == "text" for e in s)
                    reply = s.get_final_message()
            else:
                reply, pieces = client.messages.create(**kw), 1
            content = [b.model_dump() for b in reply.content]
            replies.append({"content": [{k: v for k, v in b.items() if k != "id"} for b in content],
                            "finish": reply.stop_reason, "pieces": pieces})
            uses = [b for b in content if b["type"] == "tool_use"]
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u["id"], "content": "5"} for u in uses]
                or "and?"}]
    else:
        client, items = openai.OpenAI(base_url=openai_url, api_key=gw.api_key), [question]
        for _ in range(2):
            kw = dict(model="tiny", input=items, tools=[RESPONSES_TOOL], store=False)
            if stream:
                events = list(client.responses.create(**kw, stream=True))
                reply = events[-1].response
                pieces = sum(e.type == "response.output_text.delta" and e.delta != ""
                             for e in events)
            else:
                reply, pieces = client.responses.create(**kw), 1
            out = [o.model_dump(exclude_none=True) for o in reply.output]
            replies.append({"text": reply.output_text, "finish": reply.status, "pieces": pieces,
                            "calls": [(o["name"], o["arguments"]) for o in out
                                      if o["type"] == "function_call"]})
            items += out + [{"type": "function_call_output", "call_id": o["call_id"], "output": "5"}
                            for o in out if o["type"] == "function_call"]
    session = gw.close_session(sid)
    gw.routed.router.release("r0")  # (the same episode again: the same request seeds)
    replies.append([(s.tokens, s.loss_mask, s.logprobs, s.versions) for s in session.segments])
    return replies


@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
def test_a_reply_streamed_as_generated_is_the_reply_not_streamed(streaming, wire):
    """The same episode (the same request seeds) twice, by the stock SDK: streamed, its text
    comes in pieces as the engine generates it, and the client ends with the reply, calls
    and all, that the request not streamed got; the session records the same tokens."""
    whole, streamed = (tool_round_trip(streaming, wire, stream) for stream in (False, True))
    assert [r.pop("pieces") for r in whole[:2]] == [1, 1]
    assert [r.pop("pieces") > 1 for r in streamed[:2]] == [False, True]  # (the answer's text)
    assert streamed == whole
    assert whole[0]["finish"] in ("tool_calls", "tool_use", "completed")
    outs = streaming.routed.outputs
    assert [g.token_ids for g in outs[:2]] == [g.token_ids for g in outs[2:]]


def test_the_first_text_arrives_while_the_engine_is_still_generating(streaming, tool_engine):
    """A long reply (ignore_eos): when its first text reaches the client, the engine still has
    the request in flight; the text, joined, is the reply the session records."""
    sid = streaming.open_session("r1", "g0", {**SAMPLING, "max_tokens": 400, "ignore_eos": True},
                                 8, 4096)
    client = openai.OpenAI(base_url=streaming.urls(sid)[0], api_key=streaming.api_key)
    _, done_before, _ = ray.get(tool_engine.progress.remote())
    texts, in_flight = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=TOOL_CONVERSATION[:3],
                                                stream=True):  # (answered with text at once)
        text = chunk.choices[0].delta.content
        if text and in_flight is None:
            in_flight, generated, _ = ray.get(tool_engine.progress.remote())
        texts.append(text or "")
    session = streaming.close_session(sid)
    (gen,) = streaming.routed.outputs
    assert in_flight == 1 and generated - done_before < len(gen.token_ids) == 400
    assert "".join(texts) == session.last_reply.text
    assert generated_spans(session.segments[0]) == [gen.token_ids]


def test_a_client_that_leaves_mid_stream_cancels_the_engine_request(streaming, tool_engine):
    sid = streaming.open_session("r2", "g0", {**SAMPLING, "max_tokens": 400, "ignore_eos": True},
                                 8, 4096)
    _, done_before, _ = ray.get(tool_engine.progress.remote())
    with httpx.stream("POST", f"{streaming.urls(sid)[0]}/chat/completions",
                      headers={"Authorization": f"Bearer {streaming.api_key}"},
                      json={"messages": TOOL_CONVERSATION[:3], "stream": True}) as response:
        for line in response.iter_lines():
            if '"content":' in line and '"content": ""' not in line:
                break  # the first text: the client leaves
    for _ in range(300):
        in_flight, done, _ = ray.get(tool_engine.progress.remote())
        if not in_flight:
            break
        time.sleep(0.1)
    assert in_flight == 0 and done == done_before  # (stopped before its end: not counted)
    session = streaming.close_session(sid)
    assert not session.segments and not streaming.routed.outputs
