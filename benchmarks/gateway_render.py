"""The gateway's planning time per continued turn (`Session.plan`: canonical messages, the
retry key, the continuation's ids), rendering only the new messages (`continuation`) against
rendering the whole conversation twice (`continuation_ids`), side by side, interleaved, on
the built-in tokenizer and template. No engine: each turn's reply is a fixed sampled text.

    .venv/bin/python benchmarks/gateway_render.py   # prints ms per continued turn

Two shapes: benchmarks/gateway.py's episode (a user message, then 4 turns each answered by a
short user message) and a long tool-using one (a system message with a tool, then 40 turns,
each a tool call answered by a tool result).
"""

import json
import statistics
import time

from transformers import AutoTokenizer

import instar.gateway.session as session_module
from instar.agents.chat import continuation, continuation_ids
from instar.rollout.engine import Generation
from instar.tasks.tiny_model import builtin_model
from instar.tasks.tools import CALCULATOR

REPEATS, EPISODES = 5, 50


def whole_twice(tokenizer, before, after, tools, ended_with_eos, kept):
    return continuation_ids(tokenizer, before, after, tools, ended_with_eos), None


def episode(tokenizer, shape: str) -> float:
    """Seconds `plan` takes per continued turn, over one episode."""
    if shape == "short":
        messages, tools, turns = [{"role": "user", "content": "Question 7: what comes next?"}], None, 4
        reply = {"role": "assistant", "content": "the next one is seven"}
    else:
        messages = [{"role": "system", "content": "Use the calculator."},
                    {"role": "user", "content": "Add up the numbers one to forty."}]
        tools, turns = [CALCULATOR], 40
        reply = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": "1+2"})}}]}
    text = reply["content"] or '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    gen = Generation(ids, [-1.0] * len(ids), [0] * len(ids), "stop", text)
    s = session_module.Session(tokenizer, "r", "g", {}, turns, 1 << 20)
    spent = 0.0
    for t in range(turns):
        start = time.perf_counter()
        turn = s.plan(messages, tools)
        if t:
            spent += time.perf_counter() - start
        assert turn.new_segment == (None if t else "start")
        s.record(turn, messages, tools, gen, reply, None)
        messages = messages + [reply, {"role": "tool", "content": "3"} if tools else
                               {"role": "user", "content": f"next {t}"}]
    return spent / (turns - 1)


def main():
    tokenizer = AutoTokenizer.from_pretrained(builtin_model())
    new = continuation
    for shape in ("short", "long"):
        ms = {"whole conversation twice": [], "new messages only": []}
        for _ in range(REPEATS):
            for name, way in (("whole conversation twice", whole_twice), ("new messages only", new)):
                session_module.continuation = way
                ms[name].append(1000 * statistics.mean(episode(tokenizer, shape)
                                                       for _ in range(EPISODES)))
        session_module.continuation = new
        print(shape, {k: round(statistics.median(v), 3) for k, v in ms.items()},
              "ms per continued turn (median of", REPEATS, "runs)")


if __name__ == "__main__":
    main()
