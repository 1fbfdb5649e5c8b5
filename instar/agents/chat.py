"""Chat-template rendering shared by the Env loop and the gateway (token-exact continuation).

Message text is tokenised as literal text: `<|im_start|>system` or `</tool_response>` typed
by a user, returned by a tool or written by an Env is never the template's control token.
When some text holds an added token's string, each text is wrapped in unguessable marks
before rendering, and the rendered string is tokenised piece by piece: the template's own
text as usual, the marked text with every added token's string broken in two.

A continued turn (`continuation_ids`) renders the conversation as the last reply's prompt, as
it was with the reply and as it is now, and tokenises the text after the reply's end-of-turn
token. `continuation` gives the same ids from the text kept from the turn before, rendering
only the new messages, when the template renders each message on its own (`_local`, read off
the template's syntax tree); otherwise it renders as `continuation_ids` does.
"""

import functools
import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes

Message = dict[str, Any]


def as_messages(x: str | list[Message]) -> list[Message]:
    return [{"role": "user", "content": x}] if isinstance(x, str) else list(x)


_OPEN, _CLOSE = f"\ue000{secrets.token_hex(8)}", f"{secrets.token_hex(8)}\ue001"
_MARKS = re.compile(f"({_OPEN}|{_CLOSE})")


def _marked(messages: list[Message]) -> list[Message]:
    """Each message text wrapped in the marks; empty text is left empty (it holds no token's
    string, and marked it would pass a template's `if message.content`)."""
    mark = lambda text: f"{_OPEN}{text}{_CLOSE}" if text else text  # noqa: E731
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
    `after` does not extend `before` as rendered (the history was rewritten), or when the
    template writes no eos_token in that turn (see `_continued`).
    """
    literal = _literal(tokenizer, after)  # (`after` holds `before`)
    return _continued(tokenizer, _prompt(tokenizer, before, tools, literal),
                      render(tokenizer, before, tools, False, literal),
                      render(tokenizer, after, tools, True, literal), ended_with_eos)


def _prompt(tokenizer, before: list[Message], tools: list[dict] | None,
            literal: bool = False) -> str:
    """The text the last turn of `before` answered: the messages before it, with the
    generation prompt ("" when there are none)."""
    return render(tokenizer, before[:-1], tools, True, literal) if len(before) > 1 else ""


def _continued(tokenizer, prompt: str, old: str, new: str, ended_with_eos: bool
               ) -> list[int] | None:
    """The ids of `new` after the eos_token that ends the last turn of `old`.

    `prompt`, `old`, `new`: the renders of the conversation before the turn (with the
    generation prompt), with the turn, and with the new messages too (with it). The turn ends
    at the last eos_token of `old` (outside marked text) that `new` renders too, where `new`
    and `old` have not parted yet: Phi-3.5-style templates close a conversation without
    generation prompt with one more eos_token, which `new` does not have. None when that
    eos_token is in `prompt` (the turn wrote none, as in GLM-style templates whose next
    message's header is the stop token) or there is none (the history was rewritten).
    """
    eos = tokenizer.eos_token
    for end in _ends(old, eos) if eos else ():
        stop = end + len(eos)
        if prompt.startswith(old[:stop]):  # (an earlier message's)
            return None
        if new.startswith(old[:stop]):
            return encode(tokenizer, new[stop if ended_with_eos else end:])
    return None


def _ends(text: str, token: str):
    """Where `token` begins in `text`, outside marked text, the last first."""
    i = len(text)
    while (i := text.rfind(token, 0, i)) >= 0:
        if text.rfind(_OPEN, 0, i) <= text.rfind(_CLOSE, 0, i):
            yield i


@dataclass(frozen=True, slots=True)
class Rendered:
    """The text of a conversation's first messages, kept between turns by `continuation`."""

    messages: int
    """How many messages of the conversation `text` renders."""
    text: str
    """Those messages as the template renders them, without the generation prompt."""
    first: str
    """The first message alone, rendered the same way."""
    asked: int
    """How many messages of the conversation `prompt` renders."""
    prompt: str
    """Those messages with the generation prompt: what the next reply answered (`_prompt`)."""


def continuation(tokenizer, before: list[Message], after: list[Message], tools: list[dict] | None,
                 ended_with_eos: bool, kept: Rendered | None) -> tuple[list[int] | None,
                                                                       Rendered | None]:
    """`continuation_ids`, the same ids or None, rendering as little as the template allows.

    `kept`: what the previous call returned for this conversation (its `after` is a start
    of this `before`), or None. Returns the ids and what to keep for the next turn. With a
    template that renders each message on its own (`_local`), whole-conversation text is made
    from kept text and renders of the first message with only the new messages; the whole
    conversation is rendered only where nothing was kept (with and without the reply, for
    its prompt). Otherwise, or with literal text (`_literal`), it is `continuation_ids` and
    nothing is kept.
    """
    done = kept.messages if kept else 0  # (messages before `done` were found plain before)
    if not _local(tokenizer.get_chat_template(None, tools or None)) or _literal(
            tokenizer, after[done:]):
        return continuation_ids(tokenizer, before, after, tools, ended_with_eos), None
    first = kept.first if kept else render(tokenizer, before[:1], tools, False)
    old = _more(tokenizer, kept.text, first, before[:1] + before[done:], tools, False) if kept \
        else None
    if old is None:
        old = render(tokenizer, before, tools, False)
    new = _more(tokenizer, old, first, before[:1] + after[len(before):], tools, True)
    if new is None:
        new = render(tokenizer, after, tools, True)
    prompt = kept.prompt if kept and kept.asked == len(before) - 1 else _prompt(
        tokenizer, before, tools)
    return (_continued(tokenizer, prompt, old, new, ended_with_eos),
            Rendered(len(before), old, first, len(after), new))


def _more(tokenizer, text: str, first: str, short: list[Message], tools: list[dict] | None,
          generation_prompt: bool) -> str | None:
    """The text of a conversation that renders as `text` (no generation prompt) with the
    messages `short[1:]` appended; `short[0]` is its first message, which renders as `first`.

    With a `_local` template a render is a head (what comes before the second message), the
    other messages' text, and a closing text (which `generation_prompt` chooses). `first` and
    the render of `short` share the head, so they part (at `k`) inside `first`'s closing text,
    which `text` ends with too: in `text`, what `first` has after `k` is replaced by what the
    render of `short` has after it (the new messages and closing text). None where `text`
    does not end as `first` does, which a local template never gives (render it all then).
    """
    rendered = render(tokenizer, short, tools, generation_prompt)
    k = len(os.path.commonprefix([first, rendered]))
    if not text.endswith(first[k:]):
        return None
    return text[:len(text) - len(first) + k] + rendered[k:]


_STATEFUL = {"namespace", "joiner", "cycler", "strftime_now"}  # (Jinja globals; the time)


@functools.cache
def _local(template: str) -> bool:
    """Whether the template renders each message on its own, so that the text of a longer
    conversation can be made from a shorter one's (`_more`): one `{% for m in messages %}` at
    the top, and outside it text that depends on the first message, the tools and constants.

    Inside the loop a message's text may depend on the message, `loop.first`, the first
    message (`messages[0]`), the tools and what was set before the loop, but not on other
    messages, other `loop` fields, state carried between iterations (`namespace`, `joiner`,
    `cycler`), the time, or `add_generation_prompt` (allowed only after the loop). Anything
    else, or a template this plain parser cannot read, is not local. (Jinja keeps a `set`
    inside the loop to its iteration, and transformers' sandbox refuses to mutate lists.)"""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return False
    loops = [n for n in tree.body if isinstance(n, nodes.For) and isinstance(n.iter, nodes.Name)
             and n.iter.name == "messages"]
    if len(loops) != 1 or loops[0].test or loops[0].recursive or loops[0].else_:
        return False

    def ok(node: nodes.Node, parent: nodes.Node | None, after: bool) -> bool:
        if isinstance(node, nodes.Extends | nodes.Include | nodes.Import | nodes.FromImport
                      | nodes.NSRef | nodes.Break):
            return False
        if isinstance(node, nodes.Name):
            if node.name == "messages":
                return node is loops[0].iter or (
                    isinstance(parent, nodes.Getitem) and parent.node is node
                    and isinstance(parent.arg, nodes.Const) and type(parent.arg.value) is int
                    and parent.arg.value == 0)
            if node.name == "loop":
                return isinstance(parent, nodes.Getattr) and parent.attr == "first"
            return node.name not in _STATEFUL and (after or node.name != "add_generation_prompt")
        after = after and not isinstance(node, nodes.Macro)
        return all(ok(child, node, after) for child in node.iter_child_nodes())

    end = tree.body.index(loops[0])
    return all(ok(n, tree, i > end) for i, n in enumerate(tree.body))


def canonical(message: Message) -> Message:
    """A message reduced to what the chat template renders (ids and names dropped), so a
    client's echo of an earlier turn compares equal to what instar recorded. Content is a
    string, or a list of text and image parts when it has images; an assistant's reasoning
    (`reasoning_content`, or vLLM's `reasoning`) is `reasoning_content`, which templates read.
    Each tool call is in both shapes templates read: `{name, arguments}` and OpenAI's
    `{type: "function", function: {name, arguments}}` (Llama 3.1's `tool_call.function.name`),
    the arguments parsed from JSON where they are a string."""
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
        name = f.get("name")
        calls.append({"name": name, "arguments": args, "type": "function",
                      "function": {"name": name, "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    return out
