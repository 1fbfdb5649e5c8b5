"""The OpenAI Responses wire (`/v1/responses`), beside chat completions and Anthropic messages.

Input items become the same chat messages the other wires produce, so capture, segments and
the sampling contract are the gateway's own:

    message (user | system | developer)     -> a message (developer as system)
    reasoning, message (assistant),          -> one assistant message: reasoning_content,
      function_call, function_call, ...          content, tool_calls (as instar answered them)
    function_call_output                     -> a tool message
    instructions                             -> a system message first

A reply goes out as those items again: reasoning (if the model reasoned), a message (unless
the turn is tool calls alone), a function_call per call. An agent that sends its output items
back as they came extends the recorded tokens. `previous_response_id` continues a stored
response of the same session (`store`, default true, keeps it until the episode ends; the
instructions are not carried over, as on OpenAI's service).
"""

import json
import time
from typing import Any

from instar.gateway.wire import (
    OpenAIWire,
    Reply,
    Request,
    WireError,
    _fields,
    _flag,
    _image,
    _max_tokens,
    _number,
    _typed,
    bad_request,
    sse,
)

INCLUDES = {"reasoning.encrypted_content", "message.output_text.logprobs"}
STAGE = {"reasoning": 0, "message": 1, "function_call": 2}
"""The order of an assistant turn's items: a later item of a lower stage starts a new turn."""


def response_id(reply: Reply) -> str:
    return f"resp_{reply.id}"


class ResponsesWire:
    name = "responses"
    FIELDS = {"model", "input", "instructions", "max_output_tokens", "stream", "store", "tools",
              "tool_choice", "parallel_tool_calls", "temperature", "top_p", "previous_response_id",
              "metadata", "user", "include", "prompt_cache_key", "safety_identifier"}
    NEUTRAL = {"text": {"format": {"type": "text"}}, "truncation": "disabled", "top_logprobs": 0,
               "reasoning": {}}

    @staticmethod
    def _content(content: Any, vision: bool) -> str | list[dict]:
        """Text, or text and image parts where there are images."""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise bad_request("message content must be a string or a list of parts")
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif kind == "input_image":
                parts.append(_image(p.get("image_url"), vision))
            else:
                raise bad_request(f"unsupported content part {kind!r} (instar takes text and "
                                  "base64 data-URL images)")
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)

    @classmethod
    def _messages(cls, items: Any, vision: bool) -> list[dict]:
        if isinstance(items, str):
            return [{"role": "user", "content": items}]
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise bad_request("'input' must be a string or a list of input items")
        out, turn, stage = [], None, -1
        for item in items:
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message" and item.get("role") != "assistant":
                if item.get("role") not in ("user", "system", "developer"):
                    raise bad_request(f"unsupported message role {item.get('role')!r}")
                role = "system" if item["role"] == "developer" else item["role"]
                out.append({"role": role, "content": cls._content(item.get("content"), vision)})
                turn = None
            elif kind in STAGE:  # a part of an assistant turn
                if turn is None or STAGE[kind] < stage or STAGE[kind] == stage < 2:
                    turn = {"role": "assistant", "content": ""}
                    out.append(turn)
                stage = STAGE[kind]
                if kind == "reasoning":
                    texts = [c.get("text") for c in item.get("content") or []
                             if isinstance(c, dict) and c.get("type") == "reasoning_text"]
                    text = "".join(t for t in texts if isinstance(t, str))
                    turn["reasoning_content"] = text or item.get("encrypted_content") or ""
                elif kind == "message":
                    turn["content"] = cls._content(item.get("content"), False)
                else:
                    name, args = item.get("name"), item.get("arguments")
                    if not isinstance(name, str) or not isinstance(args, str):
                        raise bad_request("a function_call item needs a 'name' and 'arguments' "
                                          "(a JSON string)")
                    turn.setdefault("tool_calls", []).append(
                        {"id": item.get("call_id"), "type": "function",
                         "function": {"name": name, "arguments": args}})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": output if isinstance(output, str)
                            else cls._content(output, vision)})
                turn = None
            else:
                raise bad_request(f"unsupported input item {kind!r} (instar takes message, "
                                  "reasoning, function_call and function_call_output items)")
        return out

    @staticmethod
    def _tools(tools: Any) -> list[dict] | None:
        if not tools:
            return None
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
                for t in tools):
            raise bad_request("'tools' must be function tools ({'type': 'function', 'name': ...}); "
                              "instar serves no built-in tools", "unsupported_parameter")
        return [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or "",
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}
            for t in tools]

    @classmethod
    def parse(cls, body: dict, vision: bool = False) -> Request:
        _fields(body, cls.FIELDS, cls.NEUTRAL)
        for name, kind in (("model", str), ("user", str), ("metadata", dict), ("instructions", str),
                           ("previous_response_id", str), ("prompt_cache_key", str),
                           ("safety_identifier", str), ("include", list)):
            _typed(body, name, kind)
        if unknown := sorted(set(body.get("include") or []) - INCLUDES, key=str):
            raise bad_request(f"include {unknown!r:.100} is not supported", "unsupported_parameter")
        if body.get("parallel_tool_calls") is False:
            raise bad_request("parallel_tool_calls=false is not supported (the model may call "
                              "several tools in one turn)", "unsupported_parameter")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise bad_request(f"tool_choice {choice!r:.40} is not supported; use 'auto' or 'none'")
        if body.get("input") is None:
            raise bad_request("'input' is required")
        messages = cls._messages(body["input"], vision)
        if not messages and body.get("previous_response_id") is None:
            raise bad_request("'input' holds no message")
        include = set(body.get("include") or [])
        _flag(body, "store")  # (a boolean; absent means true)
        echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "metadata",
                                         "previous_response_id", "temperature", "top_p", "user")}
        return Request(messages, cls._tools(body.get("tools")),
                       _max_tokens(body.get("max_output_tokens")), _flag(body, "stream"),
                       sampling={**_number(body, "temperature", 0, 2),
                                 **_number(body, "top_p", 0, 1)},
                       parse_tools=choice != "none",
                       logprobs="message.output_text.logprobs" in include,
                       instructions=body.get("instructions"),
                       previous=body.get("previous_response_id"),
                       store=body.get("store") is not False,
                       echo={**echo, "tool_choice": choice or "auto",
                             "tools": body.get("tools") or []},
                       reasoning_text_as_encrypted="reasoning.encrypted_content" in include)

    @staticmethod
    def _output(reply: Reply, encrypted: bool) -> list[dict]:
        items = []
        if reply.reasoning is not None:
            items.append({"type": "reasoning", "id": f"rs_{reply.id}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": reply.reasoning}],
                          **({"encrypted_content": reply.reasoning} if encrypted else {})})
        if reply.text or not reply.calls:
            logprobs = (OpenAIWire._logprobs(reply) or {"content": []})["content"]
            items.append({"type": "message", "id": f"msg_{reply.id}", "role": "assistant",
                          "status": "completed", "content": [{
                              "type": "output_text", "text": reply.text, "annotations": [],
                              "logprobs": logprobs}]})
        return items + [{"type": "function_call", "id": f"fc_{c['id'].removeprefix('call_')}",
                         "call_id": c["id"], "name": c["name"], "status": "completed",
                         "arguments": json.dumps(c["arguments"])} for c in reply.calls]

    @classmethod
    def response(cls, reply: Reply, model: str, req: Request) -> dict:
        incomplete = reply.finish == "length"
        return {**req.echo, "store": req.store, "id": response_id(reply), "object": "response",
                "created_at": int(time.time()), "model": model,
                "status": "incomplete" if incomplete else "completed", "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": cls._output(reply, req.reasoning_text_as_encrypted),
                "parallel_tool_calls": True, "text": {"format": {"type": "text"}},
                "truncation": "disabled",
                "usage": {"input_tokens": reply.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": reply.completion_tokens,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": reply.prompt_tokens + reply.completion_tokens}}

    @classmethod
    async def stream(cls, start: Reply, items, model: str, req: Request):
        seq = iter(range(1 << 30))

        def event(kind: str, **fields):
            return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

        def opening(i: int, message: dict) -> list[str]:
            at = {"item_id": message["id"], "output_index": i, "content_index": 0}
            return [event("response.output_item.added", output_index=i,
                          item={**message, "status": "in_progress", "content": []}),
                    event("response.content_part.added", **at,
                          part={**message["content"][0], "text": "", "logprobs": []})]

        head = {**cls.response(start, model, req), "status": "in_progress", "output": [],
                "usage": None, "incomplete_details": None}
        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        shown = ""  # text shown as it comes opens the message as item 0 (no reasoning before it)
        async for reply in items:  # (pieces of its text first)
            if isinstance(reply, str):
                if not shown:
                    message = cls._output(start, False)[0]
                    for e in opening(0, message):
                        yield e
                shown += reply
                yield event("response.output_text.delta", item_id=message["id"], output_index=0,
                            content_index=0, delta=reply, logprobs=[])
        if isinstance(reply, WireError):
            yield event("error", code=reply.code or reply.kind, message=reply.message, param=None)
            return
        done = cls.response(reply, model, req)
        for i, item in enumerate(done["output"]):
            at = {"item_id": item["id"], "output_index": i}
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                yield event("response.output_item.added", output_index=i,
                            item={**item, "content": [], "encrypted_content": None})
                yield event("response.reasoning_text.delta", **at, content_index=0, delta=text)
                yield event("response.reasoning_text.done", **at, content_index=0, text=text)
            elif item["type"] == "message":
                part = item["content"][0]
                for e in [] if shown else opening(i, item):
                    yield e
                yield event("response.output_text.delta", **at, content_index=0,
                            delta=part["text"][len(shown):], logprobs=part["logprobs"])
                yield event("response.output_text.done", **at, content_index=0,
                            text=part["text"], logprobs=part["logprobs"])
                yield event("response.content_part.done", **at, content_index=0, part=part)
            else:
                yield event("response.output_item.added", output_index=i,
                            item={**item, "status": "in_progress", "arguments": ""})
                yield event("response.function_call_arguments.delta", **at,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", **at, name=item["name"],
                            arguments=item["arguments"])
            yield event("response.output_item.done", output_index=i, item=item)
        yield event(f"response.{done['status']}", response=done)

    @staticmethod
    def error(e) -> dict:
        return {"error": {"message": e.message, "type": e.kind, "param": None, "code": e.code}}
