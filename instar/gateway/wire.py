"""The wires the gateway speaks: OpenAI chat completions and Anthropic messages (and the
OpenAI Responses API, instar/gateway/responses.py, built from the same parts).

Each wire turns a request body into chat messages + tools + options (`parse`), a generation
into the wire's response (`response`) or event stream (`stream`), and a refusal into the
wire's own error shape (`error`). `stream(start, items, ...)` starts from what is known before
generating (`start`: the reply's id and prompt size) and sends on `items`: pieces of the
reply's text as they settle (a prefix of its `text`), then the Reply, whose reasoning, rest of
the text and tool calls (each call as one delta) end the stream; or a WireError, sent as the
wire's error event. Chat messages are the Hugging Face / OpenAI form that the chat template
renders; images (OpenAI `image_url` parts, Anthropic `image` blocks, both as
base64 data) become `{"type": "image", "image": data URL}` parts (instar/agents/images.py).
Tool calls and reasoning come parsed by the engine (instar/rollout/parsers.py); reasoning goes
out as OpenAI `reasoning_content` and Anthropic `thinking` blocks, and comes back the same way
in an assistant message (as `reasoning_content`, which chat templates read).
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from instar.agents.images import image_part

THINKING_SIGNATURE = ""
"""The `signature` of the thinking blocks instar sends (the wire requires the field; instar
signs nothing and checks nothing that comes back)."""


class WireError(Exception):
    def __init__(self, status: int, kind: str, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.code = status, kind, message, code


def bad_request(message: str, code: str | None = None) -> WireError:
    return WireError(400, "invalid_request_error", message, code)


@dataclass
class Request:
    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, float] = field(default_factory=dict)
    """Sampling values the request sets explicitly (temperature, top_p, top_k)."""
    parse_tools: bool = True
    include_usage: bool = False
    seed: int | None = None
    logprobs: bool = False
    instructions: str | None = None
    """Responses: a system message put before `messages` (and before a stored conversation)."""
    previous: str | None = None
    """Responses: the stored response that `messages` continue (previous_response_id)."""
    store: bool = False
    """Responses: keep this response for a later request's previous_response_id."""
    echo: dict[str, Any] = field(default_factory=dict)
    """Responses: request fields the response repeats."""
    reasoning_text_as_encrypted: bool = False
    """Responses: include reasoning.encrypted_content (the reasoning text: nothing is encrypted)."""


@dataclass
class Reply:
    """A generation split into the assistant's reasoning, text and tool calls."""

    text: str
    calls: list[dict]
    finish: str
    """stop | length | tool_calls"""
    stop: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[tuple[str, float]] | None = None
    """(token text, log-prob) of each generated token, when the request asked for them."""
    reasoning: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """What the wire's response id is made from (a retry is answered with the same one)."""

    @property
    def message(self) -> dict:
        msg = {"role": "assistant", "content": self.text}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [{"name": c["name"], "arguments": c["arguments"]}
                                 for c in self.calls]
        return msg


def _encodable(x) -> bool:
    """Whether `x` goes into a JSON response (no NaN, no lone surrogate)."""
    try:
        json.dumps(x, ensure_ascii=False, allow_nan=False).encode()
        return True
    except (ValueError, UnicodeError):
        return False


def make_reply(gen, req: Request, prompt_tokens: int, tokenizer=None) -> Reply:
    """The wire-neutral reply from the engine's parse. Tool calls the request does not want
    (tool_choice none) or that no JSON response could carry (NaN arguments, a lone surrogate
    in a name) leave the whole completion as text, as sampled."""
    calls = gen.tool_calls if req.parse_tools and _encodable(gen.tool_calls) else []
    text, reasoning = gen.content, gen.reasoning
    if gen.content is None or len(calls) < len(gen.tool_calls):
        text, reasoning = gen.text, None
    calls = [{**c, "id": f"call_{uuid.uuid4().hex[:24]}"} for c in calls]
    finish = "tool_calls" if calls else ("length" if gen.finish_reason == "length" else "stop")
    logprobs = [(tokenizer.decode([t]), lp) for t, lp in zip(gen.token_ids, gen.logprobs)] \
        if req.logprobs else None
    return Reply(text, calls, finish, gen.stop, prompt_tokens, len(gen.token_ids), logprobs,
                 reasoning)


def _fields(body: dict, known: set[str], neutral: dict[str, Any]) -> None:
    """Every field is one instar honours; those that would change the sampling distribution
    (the trainer recomputes log-probs without them) only at their neutral value."""
    if unknown := sorted(set(body) - known - set(neutral)):
        raise bad_request(f"unsupported field(s) {', '.join(map(repr, unknown))[:200]}",
                          "unsupported_parameter")
    for name, value in neutral.items():
        if body.get(name) is not None and (body[name] != value or isinstance(body[name], bool)):
            raise bad_request(f"'{name}' changes the sampling distribution, which the trainer does "
                              f"not reproduce; leave it unset (or {json.dumps(value)})",
                              "unsupported_parameter")


def _typed(body: dict, name: str, kind: type) -> None:
    if body.get(name) is not None and not isinstance(body[name], kind):
        raise bad_request(f"'{name}' must be a {kind.__name__}")


def _number(body: dict, name: str, lo: float, hi: float) -> dict:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be a number in [{lo}, {hi}], got {value!r}")
    return {name: float(value)}


MAX_TOKENS_LIMIT = 1 << 31


def _max_tokens(value) -> int | None:
    """A positive integer, strictly: JSON `true` is not 1 (Python's bool is an int)."""
    if value is None:
        return None
    if type(value) is not int or not 1 <= value < MAX_TOKENS_LIMIT:
        raise bad_request(f"'max_tokens' must be a positive integer below {MAX_TOKENS_LIMIT}, "
                          f"got {json.dumps(value)[:40]}")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise bad_request(f"'{name}' must be true or false, got {json.dumps(value)[:40]}")


def _stop_list(stop, name: str = "stop") -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list) and all(isinstance(s, str) and s for s in stops):
        return stops
    raise bad_request(f"'{name}' must be a non-empty string or a list of non-empty strings")


def _image(url: Any, vision: bool) -> dict:
    if not vision:  # (refused before anything is decoded)
        raise bad_request("this model takes no images", "invalid_image")
    if not isinstance(url, str):
        raise bad_request(f"an image needs a data URL string, got {type(url).__name__}",
                          "invalid_image")
    try:
        return image_part(url)
    except ValueError as e:
        raise bad_request(f"invalid image: {e}", "invalid_image") from e


def _openai_parts(content: Any, vision: bool) -> Any:
    """`image_url` parts as image parts; everything else as it is."""
    if not isinstance(content, list):
        return content
    return [_image((p.get("image_url") or {}).get("url") if isinstance(p.get("image_url"), dict)
                   else p.get("image_url"), vision)
            if isinstance(p, dict) and p.get("type") == "image_url" else p for p in content]


async def whole(reply: Reply):
    """The items of a reply streamed whole (see each wire's `stream`)."""
    yield reply


def sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIWire:
    name = "openai"
    FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "stream",
              "stream_options", "stop", "temperature", "top_p", "top_k", "n", "tools",
              "tool_choice", "parallel_tool_calls", "seed", "logprobs", "top_logprobs", "user",
              "metadata"}
    NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1,
               "min_p": 0, "logit_bias": {}, "response_format": {"type": "text"}}

    @classmethod
    def parse(cls, body: dict, vision: bool = False) -> Request:
        _fields(body, cls.FIELDS, cls.NEUTRAL)
        for name, kind in (("model", str), ("user", str), ("metadata", dict)):
            _typed(body, name, kind)
        if body.get("top_logprobs"):
            raise bad_request("top_logprobs is not supported: instar returns the sampled "
                              "token's log-prob (logprobs: true)", "unsupported_parameter")
        if body.get("parallel_tool_calls") is False:
            raise bad_request("parallel_tool_calls=false is not supported (the model may call "
                              "several tools in one turn)", "unsupported_parameter")
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << 63):
            raise bad_request("'seed' must be a non-negative integer below 2**63")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) and "role" in m for m in messages):
            raise bad_request("'messages' must be a non-empty list of messages with a 'role'")
        if body.get("n", 1) != 1:
            raise bad_request("only n=1 is supported")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise bad_request(f"tool_choice {choice!r} is not supported; use 'auto' or 'none'")
        tools = body.get("tools") or None
        if tools is not None and not all(isinstance(t, dict) and "function" in t for t in tools):
            raise bad_request("'tools' must be a list of {'type': 'function', 'function': ...}")
        msgs = [{**m, "role": "system" if m["role"] == "developer" else m["role"],
                 **({"content": _openai_parts(m["content"], vision)} if "content" in m else {})}
                for m in messages]
        max_tokens = _max_tokens(body.get("max_completion_tokens", body.get("max_tokens")))
        options = body.get("stream_options")
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object")
        top_k = body.get("top_k")
        if top_k is not None and (type(top_k) is not int or top_k not in (-1, 0)):
            raise bad_request(f"top_k={json.dumps(top_k)[:20]} differs from the run's (none): the "
                              "trainer recomputes log-probs from the full distribution; leave "
                              "top_k unset", "unsupported_value")
        return Request(msgs, tools, max_tokens, _flag(body, "stream"), _stop_list(body.get("stop")),
                       {**_number(body, "temperature", 0, 2), **_number(body, "top_p", 0, 1)},
                       parse_tools=choice != "none", include_usage=_flag(options, "include_usage"),
                       seed=seed, logprobs=_flag(body, "logprobs"))

    @staticmethod
    def _calls(reply: Reply) -> list[dict]:
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for c in reply.calls]

    @staticmethod
    def _usage(reply: Reply) -> dict:
        return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                "total_tokens": reply.prompt_tokens + reply.completion_tokens}

    @staticmethod
    def _logprobs(reply: Reply) -> dict | None:
        return None if reply.logprobs is None else {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in reply.logprobs]}

    @classmethod
    def response(cls, reply: Reply, model: str, req: Request) -> dict:
        message = {"role": "assistant", "content": reply.text or None}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = cls._calls(reply)
        return {"id": f"chatcmpl-{reply.id}", "object": "chat.completion",
                "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": reply.finish,
                             "logprobs": cls._logprobs(reply)}],
                "usage": cls._usage(reply)}

    @classmethod
    async def stream(cls, start: Reply, items, model: str, req: Request):
        head = {"id": f"chatcmpl-{start.id}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model}
        chunk = lambda delta, finish=None, logprobs=None: {**head, "choices": [  # noqa: E731
            {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
        yield sse(chunk({"role": "assistant", "content": ""}))
        shown = ""
        async for reply in items:  # (pieces of its text first)
            if isinstance(reply, str):
                shown += reply
                yield sse(chunk({"content": reply}))
        if isinstance(reply, WireError):
            yield sse(cls.error(reply))
            return
        if reply.reasoning is not None:
            yield sse(chunk({"reasoning_content": reply.reasoning}))
        if reply.text[len(shown):] or reply.logprobs:
            yield sse(chunk({"content": reply.text[len(shown):]}, logprobs=cls._logprobs(reply)))
        for i, call in enumerate(cls._calls(reply)):
            yield sse(chunk({"tool_calls": [{"index": i, **call}]}))
        yield sse(chunk({}, reply.finish))
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": cls._usage(reply)})
        yield sse("[DONE]")

    @staticmethod
    def error(e: WireError) -> dict:
        return {"error": {"message": e.message, "type": e.kind, "param": None, "code": e.code}}


class AnthropicWire:
    name = "anthropic"
    FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
              "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata"}
    KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 503: "overloaded_error"}

    @staticmethod
    def _text(content) -> str:
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise bad_request("message content must be a string or a list of blocks")
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise bad_request(f"unsupported content block here: {block!r:.80}")
            parts.append(block.get("text", ""))
        return "".join(parts)

    @staticmethod
    def _image(block: dict, vision: bool) -> dict:
        if not vision:
            return _image(None, vision)
        source = block.get("source")
        if not isinstance(source, dict) or source.get("type") != "base64":
            raise bad_request("an image block needs a base64 source (instar fetches nothing "
                              "from the network)", "invalid_image")
        return _image(f"data:{source.get('media_type')};base64,{source.get('data')}", vision)

    @classmethod
    def _content(cls, content, vision: bool) -> str | list[dict]:
        """Text, or text and image parts where there are images."""
        if not isinstance(content, list) or not any(
                isinstance(b, dict) and b.get("type") == "image" for b in content):
            return cls._text(content)
        return [cls._image(b, vision) if isinstance(b, dict) and b.get("type") == "image"
                else {"type": "text", "text": cls._text([b])} for b in content]

    @classmethod
    def parse(cls, body: dict, vision: bool = False) -> Request:
        _fields(body, cls.FIELDS, {})
        for name, kind in (("model", str), ("metadata", dict)):
            _typed(body, name, kind)
        messages, max_tokens = body.get("messages"), body.get("max_tokens")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages: field required (a non-empty list)")
        if max_tokens is None:
            raise bad_request("max_tokens: field required (a positive integer)")
        _max_tokens(max_tokens)
        choice = (body.get("tool_choice") or {"type": "auto"}).get("type")
        if choice not in ("auto", "none"):
            raise bad_request(f"tool_choice type {choice!r} is not supported; use 'auto' or 'none'")
        out = [{"role": "system", "content": cls._text(body["system"])}] if body.get("system") else []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise bad_request("each message needs role 'user' or 'assistant'")
            blocks = m["content"] if isinstance(m.get("content"), list) else \
                [{"type": "text", "text": cls._text(m.get("content"))}]
            parts, calls, thinking = [], [], []
            for b in blocks:
                kind = b.get("type") if isinstance(b, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": b.get("text", "")})
                elif kind == "thinking" and m["role"] == "assistant" and isinstance(
                        b.get("thinking"), str):  # (its signature is not checked)
                    thinking.append(b["thinking"])
                elif kind == "image" and m["role"] == "user":
                    parts.append(cls._image(b, vision))
                elif kind == "tool_use" and m["role"] == "assistant":
                    calls.append({"name": b.get("name"), "arguments": b.get("input") or {}})
                elif kind == "tool_result" and m["role"] == "user":
                    out.append({"role": "tool",
                                "content": cls._content(b.get("content") or "", vision)})
                else:
                    raise bad_request(f"unsupported content block {kind!r} in a {m['role']} message")
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            if m["role"] == "assistant":
                out.append({"role": "assistant", "content": text,
                            **({"reasoning_content": "".join(thinking)} if thinking else {}),
                            **({"tool_calls": calls} if calls else {})})
            elif parts:  # text parts and images as a list, text alone as a string
                out.append({"role": "user", "content": parts if any(
                    p["type"] == "image" for p in parts) else text})
        tools = [{"type": "function", "function": {"name": t.get("name"),
                                                   "description": t.get("description", ""),
                                                   "parameters": t.get("input_schema", {})}}
                 for t in body.get("tools") or []] or None
        return Request(out, tools, max_tokens, _flag(body, "stream"),
                       _stop_list(body.get("stop_sequences"), "stop_sequences"),
                       {**_number(body, "temperature", 0, 1), **_number(body, "top_p", 0, 1),
                        **_number(body, "top_k", 0, 1e9)},
                       parse_tools=choice != "none")

    @staticmethod
    def _blocks(reply: Reply) -> list[dict]:
        blocks = [{"type": "thinking", "thinking": reply.reasoning,
                   "signature": THINKING_SIGNATURE}] if reply.reasoning is not None else []
        blocks += [{"type": "text", "text": reply.text}] if reply.text else []
        return blocks + [{"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["name"],
                          "input": c["arguments"]} for c in reply.calls]

    @staticmethod
    def _stop_reason(reply: Reply) -> str:
        return {"tool_calls": "tool_use", "length": "max_tokens"}.get(
            reply.finish, "stop_sequence" if reply.stop else "end_turn")

    @classmethod
    def response(cls, reply: Reply, model: str, req: Request | None = None) -> dict:
        return {"id": f"msg_{reply.id}", "type": "message", "role": "assistant",
                "model": model, "content": cls._blocks(reply),
                "stop_reason": cls._stop_reason(reply), "stop_sequence": reply.stop,
                "usage": {"input_tokens": reply.prompt_tokens,
                          "output_tokens": reply.completion_tokens}}

    @classmethod
    async def stream(cls, start: Reply, items, model: str, req: Request):
        msg = cls.response(start, model)
        yield sse({"type": "message_start", "message": {
            **msg, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**msg["usage"], "output_tokens": 0}}}, "message_start")
        shown = ""  # (text shown as it came opens block 0: no reasoning came before it)
        async for reply in items:  # (pieces of its text first)
            if isinstance(reply, str):
                if not shown:
                    yield sse({"type": "content_block_start", "index": 0, "content_block": {
                        "type": "text", "text": ""}}, "content_block_start")
                shown += reply
                yield sse({"type": "content_block_delta", "index": 0, "delta": {
                    "type": "text_delta", "text": reply}}, "content_block_delta")
        if isinstance(reply, WireError):
            yield sse(cls.error(reply), "error")
            return
        msg = cls.response(reply, model)
        for i, block in enumerate(msg["content"]):
            if block["type"] == "text":
                start = {**block, "text": ""}
                delta = {"type": "text_delta", "text": block["text"][len(shown):]}
            elif block["type"] == "thinking":
                start = {**block, "thinking": ""}
                delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            else:
                start = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            if not (shown and i == 0):
                yield sse({"type": "content_block_start", "index": i, "content_block": start},
                          "content_block_start")
            yield sse({"type": "content_block_delta", "index": i, "delta": delta},
                      "content_block_delta")
            yield sse({"type": "content_block_stop", "index": i}, "content_block_stop")
        yield sse({"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"],
                                                      "stop_sequence": msg["stop_sequence"]},
                   "usage": {"output_tokens": reply.completion_tokens}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    @classmethod
    def error(cls, e: WireError) -> dict:
        return {"type": "error", "error": {"type": cls.KINDS.get(e.status, e.kind),
                                           "message": e.message}}
