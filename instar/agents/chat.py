"""Chat-template rendering shared by the Env loop and the gateway (token-exact continuation)."""

import json
from typing import Any

Message = dict[str, Any]


def as_messages(x: str | list[Message]) -> list[Message]:
    return [{"role": "user", "content": x}] if isinstance(x, str) else list(x)


def render(tokenizer, messages: list[Message], tools: list[dict] | None,
           generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def prompt_ids(tokenizer, messages: list[Message], tools: list[dict] | None) -> list[int]:
    """Token ids of a whole conversation, ending with the assistant's generation prompt."""
    return tokenizer.encode(render(tokenizer, messages, tools, True), add_special_tokens=False)


def continuation_ids(tokenizer, before: list[Message], after: list[Message],
                     tools: list[dict] | None, ended_with_eos: bool) -> list[int] | None:
    """Ids to append after the last generated token so the context becomes `after`.

    `before` ends with the assistant turn just generated; `after` extends it with new
    messages. Only the text the template renders after that turn's end-of-turn token is
    tokenised (with the token itself when the generation stopped without it). None when
    `after` does not extend `before` as rendered (the history was rewritten).
    """
    eos = tokenizer.eos_token
    old, new = render(tokenizer, before, tools, False), render(tokenizer, after, tools, True)
    if eos not in old:
        return None
    cut = old.rindex(eos) + (len(eos) if ended_with_eos else 0)
    if not new.startswith(old[:cut]):
        return None
    return tokenizer.encode(new[cut:], add_special_tokens=False)


def canonical(message: Message) -> Message:
    """A message reduced to what the chat template renders (ids and names dropped), so a
    client's echo of an earlier turn compares equal to what instar recorded. Content is a
    string, or a list of text and image parts when it has images."""
    content = message.get("content")
    if isinstance(content, list) and any(p.get("type") == "image" for p in content):
        content = [p if p["type"] == "image" else {"type": "text", "text": p.get("text", "")}
                   for p in content if p.get("type") in ("text", "image")]
    elif isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
    out: Message = {"role": message["role"], "content": content or ""}
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
