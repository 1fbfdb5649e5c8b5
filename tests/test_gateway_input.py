"""Hostile and careless requests are refused by the gateway itself with a 400 in the wire's
own error shape, before anything reaches the engine (the gateway here has no engine: a call
to it fails the test). Requests that reach the engine: tests/test_gateway.py."""

import httpx
import pytest

from instar.gateway.server import Gateway

MESSAGE = [{"role": "user", "content": "hi"}]
OPENAI = {"messages": MESSAGE}
ANTHROPIC = {"messages": MESSAGE, "max_tokens": 8}

HOSTILE = {  # name -> (wire, body or raw bytes)
    "openai max_tokens true": ("openai", {**OPENAI, "max_tokens": True}),
    "anthropic max_tokens true": ("anthropic", {**ANTHROPIC, "max_tokens": True}),
    "max_tokens too large": ("openai", {**OPENAI, "max_completion_tokens": 1 << 40}),
    "max_tokens a float": ("anthropic", {**ANTHROPIC, "max_tokens": 8.0}),
    "stream a string": ("openai", {**OPENAI, "stream": "false"}),
    "anthropic stream a number": ("anthropic", {**ANTHROPIC, "stream": 0}),
    "include_usage a string": ("openai", {**OPENAI, "stream": True,
                                          "stream_options": {"include_usage": "yes"}}),
    "stream_options a list": ("openai", {**OPENAI, "stream_options": []}),
    "empty stop": ("openai", {**OPENAI, "stop": ""}),
    "empty stop_sequences": ("anthropic", {**ANTHROPIC, "stop_sequences": [""]}),
    # raw bodies, each valid but for the one fault, so that the fault alone is refused
    "nested 100,000 deep": ("openai", b'{"messages": [{"role": "user", "content": '
                            + b"[" * 100_000 + b"]" * 100_000 + b"}]}"),
    "a 5,000-digit integer": ("anthropic", b'{"messages": [{"role": "user", "content": "hi"}], '
                              b'"max_tokens": ' + b"9" * 5000 + b"}"),
    "not UTF-8": ("openai", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
}


class NoEngine:
    calls = 0

    async def __call__(self, *args):
        NoEngine.calls += 1
        raise AssertionError("a refused request reached the engine")


@pytest.fixture(scope="module")
def gateway(tokenizer):
    gw = Gateway(NoEngine(), tokenizer, model="tiny", max_model_len=512).start()
    yield gw
    gw.stop()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_bad_requests_get_a_400_in_the_wires_shape_and_never_reach_the_engine(gateway, name):
    wire, body = HOSTILE[name]
    sid = gateway.open_session("r0", "g0", {"temperature": 1.0, "max_tokens": 8}, 4, 512)
    openai_url, anthropic_url = gateway.urls(sid)
    url = f"{openai_url}/chat/completions" if wire == "openai" else f"{anthropic_url}/v1/messages"
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    reply = httpx.post(url, headers={"Authorization": f"Bearer {gateway.api_key}",
                                     "Content-Type": "application/json"}, timeout=30, **kwargs)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    if wire == "openai":
        assert error["error"]["type"] == "invalid_request_error"
    else:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in reply.text and NoEngine.calls == 0
    assert not gateway.close_session(sid).segments  # nothing recorded


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_no_route_answers_without_the_key(gateway, path):
    assert httpx.get(gateway.base + path, timeout=30).status_code == 404
