"""Hypothesis strategies for requests to the gateway: both wires, every field it knows and some
it does not, values of every JSON type (NaN, huge integers, lone surrogates, special-token
text), mostly well-formed so that many reach the engine. Used by tests/test_gateway_fuzz.py
and benchmarks/reliability.py."""

import json

from hypothesis import strategies as st

from instar.gateway.wire import AnthropicWire, OpenAIWire

SPECIAL = ["<|im_start|>system\n", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
           "<|image_pad|>", "\ud800", "a\udfffb", "\x00"]
text = st.one_of(st.text(max_size=30), st.sampled_from(SPECIAL))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                    st.floats(allow_nan=True, allow_infinity=True), text)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(text, inner, max_size=3), max_leaves=8)
roles = st.sampled_from(["user", "user", "assistant", "system", "tool", "developer"]) | text
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image_url", "image", "tool_use", "tool_result"])},
    optional={"text": text | values, "image_url": values, "source": values, "content": values,
              "input": values, "name": text, "id": text})
messages = st.lists(st.fixed_dictionaries(
    {"role": roles, "content": st.one_of(text, text, st.lists(parts, max_size=3), values)},
    optional={"tool_calls": values, "name": text}), min_size=1, max_size=4)
tools = st.lists(st.one_of(st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": text}, optional={"parameters": values})}),
    st.fixed_dictionaries({"name": text}, optional={"input_schema": values}), values), max_size=2)
PLAUSIBLE = {
    "max_tokens": st.integers(-2, 40) | values, "max_completion_tokens": st.integers(0, 40),
    "temperature": st.sampled_from([0, 1, 1.0, 2.5, -1]) | values,
    "stop": st.one_of(text, st.lists(text, max_size=3)), "stop_sequences": st.lists(text, max_size=3),
    "stream": st.booleans() | values, "tools": tools, "seed": st.integers(-1, 1 << 64) | values,
    "logprobs": st.booleans(), "top_k": st.sampled_from([-1, 0, 5]), "system": text | values,
}
FIELDS = sorted((OpenAIWire.FIELDS | set(OpenAIWire.NEUTRAL) | AnthropicWire.FIELDS | {"best_of"})
                - {"messages"})
bodies = st.fixed_dictionaries({"messages": messages}, optional={
    name: PLAUSIBLE.get(name, values) for name in FIELDS})


@st.composite
def requests(draw) -> tuple[str, bytes]:
    """(wire, body bytes): mostly JSON objects (NaN and surrogates as Python's json writes
    them), sometimes any bytes."""
    wire = draw(st.sampled_from(["openai", "anthropic"]))
    if draw(st.integers(0, 9)) == 0:
        return wire, draw(st.binary(max_size=64))
    return wire, json.dumps(draw(bodies)).encode()
