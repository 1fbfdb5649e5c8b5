"""Property-based fuzzing of both wires on the real engine (benchmarks/fuzz.py makes the
requests): no 5xx, no hang, and afterwards the engine still answers and the gateway's memory
has not grown without bound. Bounded in count; derandomised, so CI runs the same cases."""

import sys
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings

from instar.gateway.server import Gateway
from instar.rollout.router import Router
from instar.rollout.versions import Versions

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from fuzz import requests  # noqa: E402

sys.path.pop(0)
pytestmark = pytest.mark.stack
SAMPLING = {"temperature": 1.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def gateway(engine, tokenizer):
    gw = Gateway(Router([engine], Versions(), hang_s=30).generate, tokenizer, model="tiny",
                 max_model_len=1024, max_body_mb=1).start()
    gw.rss = [psutil.Process().memory_info().rss]
    yield gw
    gw.stop()


def post(gw, wire: str, sid: str, content: bytes) -> httpx.Response:
    openai_url, anthropic_url = gw.urls(sid)
    url = f"{openai_url}/chat/completions" if wire == "openai" else f"{anthropic_url}/v1/messages"
    return httpx.post(url, content=content, timeout=60, headers={
        "Authorization": f"Bearer {gw.api_key}", "Content-Type": "application/json"})


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=requests())
def test_fuzzed_requests_never_get_a_5xx_or_hang(gateway, case):
    wire, body = case
    sid = gateway.open_session("fuzz", "fuzz", SAMPLING, 4, 64)
    try:
        reply = post(gateway, wire, sid, body)  # (a hang fails it: httpx's timeout)
        assert reply.status_code < 500, reply.text
        assert "Traceback" not in reply.text
    finally:
        gateway.close_session(sid)


def test_after_fuzzing_the_engine_answers_and_memory_is_bounded(gateway):
    sid = gateway.open_session("plain", "plain", SAMPLING, 4, 64)
    reply = post(gateway, "openai", sid, b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]
    growth = psutil.Process().memory_info().rss - gateway.rss[0]
    assert growth < 256 << 20, f"the gateway's process grew by {growth >> 20} MB"
