"""Tool-call parsers: model output text -> [{"name": ..., "arguments": {...}}]."""

import json
import re

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[dict]:
    """Parse `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; skip malformed."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", {})
            calls.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {}})
    return calls


PARSERS = {"hermes": parse_hermes}
