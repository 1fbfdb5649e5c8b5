"""Chat-template rendering shared by the Env loop and the gateway (token-exact continuation).

Message text is tokenised as literal text: `<|im_start|>system` or `</tool_response>` typed
by a user, returned by a tool or written by an Env is never the template's control token.
When some text holds an added token's string, each text is wrapped in unguessable marks
before rendering, and the rendered string is tokenised piece by piece: the template's own
text as usual, the marked text with every added token's string broken in two.
"""

import functools
import json
import re
import secrets
from typing import Any

Message = dict[str, Any]


def as_messages(x: str | list[Message]) -> list[Message]:
    return [{"role": "user", "content": x}] if isinstance(x, str) else list(x)


_OPEN, _CLOSE = f"\ue000{secrets.token_hex(8)}", f"{secrets.token_hex(8)}\ue001"
_MARKS = re.compile(f"({_OPEN}|{_CLOSE})")


def _marked(messages: list[Message]) -> list[Message]:
    mark = lambda text: f"{_OPEN}{text}{_CLOSE}"  # noqa: E731
    messages = [{**m, "reasoning_content": mark(m["reasoning_content"])}
                if isinstance(m.get("reasoning_content"), str) else m for m in messages]
    return [{**m, "content": mark(m["content"]) if isinstance(m.get("content"), str) else
             [{**p, "text": mark(p["text"])} if isinstance(p, dict) and isinstance(
                 p.get("text"), str) else p for p in m["content"]]}
            if isinstance(m.get("content"), str | list) else m for m in messages]


@functools.cache
def _added(tokenizer) -> re.Pattern:
    """The strings of the tokenizer's added tokens (special or not), longest first."""
    tokens = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, tokens)) + ")")


def _literal(tokenizer, messages: list[Message]) -> bool:
    """Whether some message text holds an added token's string (then it is rendered marked)."""
    texts = [c if isinstance(c := m.get(key), str) else "" for m in messages
             for key in ("content", "reasoning_content")] + [
        p["text"] for m in messages if isinstance(m.get("content"), list) for p in m["content"]
        if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return any(_added(tokenizer).search(text) for text in texts)


def render(tokenizer, messages: list[Message], tools: list[dict] | None,
           generation_prompt: bool, literal: bool = False) -> str:
    """The template's text; `literal`: message texts wrapped in the marks `encode` reads
    (refused if the template changes text it renders, e.g. strips it)."""
    def text(msgs):
        return tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    if not literal:
        return text(messages)
    marked = text(_marked(messages))
    if _MARKS.sub("", marked) != text(messages):
        raise ValueError("this chat template rewrites message text, so text that holds a "
                         "special token's string cannot be kept literal")
    return marked


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text; the marked parts literally (see the module docstring)."""
    ids, inside = [], False
    for part in _MARKS.split(text):
        if part in (_OPEN, _CLOSE):
            inside = part == _OPEN
            continue
        pieces = [part]
        if inside:  # "<tool_call>" as "<" and "tool_call>": no piece is an added token
            pieces = [p for i, piece in enumerate(_added(tokenizer).split(part))
                      for p in ([piece[:1], piece[1:]] if i % 2 else [piece])]
        ids += [t for p in pieces if p for t in tokenizer.encode(p, add_special_tokens=False)]
    return ids


def prompt_ids(tokenizer, messages: list[Message], tools: list[dict] | None) -> list[int]:
    """Token ids of a whole conversation, ending with the assistant's generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, tools, True,
                                    _literal(tokenizer, messages)))


def continuation_ids(tokenizer, before: list[Message], after: list[Message],
                     tools: list[dict] | None, ended_with_eos: bool) -> list[int] | None:
    """Ids to append after the last generated token so the context becomes `after`.

    `before` ends with the assistant turn just generated; `after` extends it with new
    messages. Only the text the template renders after that turn's end-of-turn token is
    tokenised (with the token itself when the generation stopped without it). None when
    `after` does not extend `before` as rendered (the history was rewritten).
    """
    eos, literal = tokenizer.eos_token, _literal(tokenizer, after)  # (`after` holds `before`)
    old = render(tokenizer, before, tools, False, literal)
    new = render(tokenizer, after, tools, True, literal)
    if eos not in old:
        return None
    cut = old.rindex(eos) + (len(eos) if ended_with_eos else 0)
    if not new.startswith(old[:cut]):
        return None
    return encode(tokenizer, new[cut:])


def canonical(message: Message) -> Message:
    """A message reduced to what the chat template renders (ids and names dropped), so a
    client's echo of an earlier turn compares equal to what instar recorded. Content is a
    string, or a list of text and image parts when it has images; an assistant's reasoning
    (`reasoning_content`, or vLLM's `reasoning`) is `reasoning_content`, which templates read."""
    content = message.get("content")
    if isinstance(content, list) and any(p.get("type") == "image" for p in content):
        content = [p if p["type"] == "image" else {"type": "text", "text": p.get("text", "")}
                   for p in content if p.get("type") in ("text", "image")]
    elif isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
    out: Message = {"role": message["role"], "content": content or ""}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str):
        out["reasoning_content"] = reasoning
    calls = []
    for call in message.get("tool_calls") or []:
        f = call.get("function", call)
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"name": f.get("name"), "arguments": args})
    if calls:
        out["tool_calls"] = calls
    return out
