"""Tool calls and reasoning in a completion, by vLLM's parsers, on the engine's side.

    completion text --reasoning parser--> reasoning | the rest --tool parser--> tool calls | content

`--model.tool-parser` and `--model.reasoning-parser` name parsers of vLLM's registries
(`ToolParserManager`: hermes, llama3_json, mistral, qwen3_coder, ...; `ReasoningParserManager`:
qwen3, deepseek_r1, mistral, ...), or `none` (off). Empty: detected from the chat template
(`detect`). Each engine parses its finished generations (instar/rollout/engine.py), so Env
agents (`Action`) and ChatAgents (the gateway's wires) get the same parse and agent code never
imports vLLM. Parsing reads the text only: the sampled tokens stay as they were sampled.
While a completion is being generated, `settled` says how much of its reply a stream may
already show.
"""

import json
import logging
from dataclasses import dataclass, field

OFF = "none"

TOOL_FAMILIES = [  # (a marker in the chat template, the token it needs, the tool parser)
    ("<function=", "<tool_call>", "qwen3_coder"),  # (XML calls inside <tool_call>: before hermes)
    ("<tool_call>", "<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "<|python_tag|>", "llama3_json"),
]
REASONING_FAMILIES = [("[THINK]", "[THINK]", "mistral"), ("<think>", "<think>", "qwen3")]
CALL_STARTS = {"hermes": ["<tool_call>"], "qwen3_coder": ["<tool_call>", "<function="],
               "mistral": ["[TOOL_CALLS]"]}
"""Tool parsers whose reply, when calls parse, is the text before the first call (stripped),
and what a call may begin with: a stream shows their reply as it comes (`Parsers.settled`).
Other parsers' replies come whole at the end (llama3_json, say, reads a call at any "{")."""


def detect(chat_template: str | None, vocab: dict[str, int]) -> tuple[str, str]:
    """(tool parser, reasoning parser) for a model: the first family whose marker its chat
    template holds and whose token its tokenizer has; else hermes (the built-in model's format)
    and no reasoning parser."""
    def first(families, default):
        return next((name for marker, token, name in families
                     if marker in (chat_template or "") and token in vocab), default)
    return first(TOOL_FAMILIES, "hermes"), first(REASONING_FAMILIES, OFF)


def check(tool_parser: str, reasoning_parser: str) -> None:
    """Refuse a parser name vLLM's registry does not hold (imports vLLM's parsers, some
    seconds, only when a name is given)."""
    named = [(flag, name) for flag, name in (("--model.tool-parser", tool_parser),
                                             ("--model.reasoning-parser", reasoning_parser))
             if name not in ("", OFF)]
    if not named:
        return
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for flag, name in named:
        manager = ToolParserManager if flag == "--model.tool-parser" else ReasoningParserManager
        if name not in (known := manager.list_registered()):
            raise ValueError(f"{flag} {name!r} is not a vLLM parser; known: {OFF} (off), "
                             f"{', '.join(known)} (empty: detected from the chat template)")


@dataclass(frozen=True, slots=True)
class Parsed:
    """A completion's text, split. Example: `<think>2+3</think>Sure.<tool_call>{"name": "add",
    "arguments": {"a": 2}}</tool_call>` -> reasoning "2+3", content "Sure.", one call."""

    reasoning: str | None
    """The reasoning ("thinking"); None when the text has none."""
    content: str
    """The reply: the text without its reasoning and without the tool calls' markup (the
    markup stays when no call parsed)."""
    tool_calls: list[dict] = field(default_factory=list)
    """Each `{"name": str, "arguments": dict}`."""
    tool_call_errors: int = 0
    """Calls that began (the parser's start marker, or a call it returned) but did not parse
    into a name and a JSON object of arguments."""


def _call(call) -> dict | None:
    """vLLM's ToolCall as `{"name", "arguments": dict}`; None if its arguments are no object."""
    try:
        arguments = json.loads(call.function.arguments)
    except (TypeError, ValueError):
        return None
    return {"name": call.function.name, "arguments": arguments} \
        if isinstance(arguments, dict) and isinstance(call.function.name, str) else None


def _start(text: str, marker: str) -> int:
    """Where `marker` begins in `text`, or may begin (a part of it at the end); else len(text)."""
    if (i := text.find(marker)) >= 0:
        return i
    return len(text) - next((k for k in range(len(marker) - 1, 0, -1)
                             if text.endswith(marker[:k])), 0)


class Parsers:
    """The run's tool and reasoning parsers for one tokenizer; `parse(text)` per completion."""

    def __init__(self, tokenizer, tool_parser: str = "", reasoning_parser: str = ""):
        template = getattr(tokenizer, "chat_template", None)
        detected = detect(template if isinstance(template, str) else None, tokenizer.get_vocab())
        self.names = (tool_parser or detected[0], reasoning_parser or detected[1])
        check(*self.names)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        # a malformed call is counted (tool_call_errors), not logged with a traceback each time
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
        self.request = ChatCompletionRequest(messages=[], model="")  # (what the parsers read)
        self.tool = self._build(ToolParserManager.get_tool_parser, "--model.tool-parser",
                                self.names[0], tokenizer)
        self.reasoning = self._build(ReasoningParserManager.get_reasoning_parser,
                                     "--model.reasoning-parser", self.names[1], tokenizer)
        self.marker = self.tool and (getattr(self.tool, "tool_call_start_token", None) or
                                     getattr(self.tool, "bot_token", None))
        """Where a call begins (hermes: <tool_call>, llama3_json and mistral: their bot token)."""

    @staticmethod
    def _build(get, flag: str, name: str, tokenizer):
        if name == OFF:
            return None
        try:
            return get(name)(tokenizer)
        except Exception as e:
            raise ValueError(f"{flag} {name} cannot parse this model's output: {e}") from e

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        """A text with neither of the reasoning's markers has none (vLLM's non-streaming
        parsers take such a text as unfinished reasoning: right for a reasoning cut short, wrong
        for a model that did not think)."""
        r = self.reasoning
        if r is None:
            return None, text
        marks = [m for m in (r.reasoning_start_str, r.reasoning_end_str) if m]
        if marks and not any(m in text for m in marks):
            return None, text
        reasoning, content = r.extract_reasoning(text, self.request)
        return reasoning, content or ""

    def settled(self, text: str) -> str:
        """The start of the reply (`parse(...).content`) that no continuation of `text`, a
        completion so far, can change: what a stream may show before the completion ends.
        Without parsers, all of `text`; with a tool parser of CALL_STARTS, `text` up to where a
        call may begin, less trailing space (a call strips the reply), and nothing if `text`
        begins with a space (the same); with a reasoning parser or another tool parser, nothing
        (where the reasoning or the reply ends is known at the end only)."""
        if self.reasoning is not None:
            return ""
        if self.tool is None:
            return text
        if self.names[0] not in CALL_STARTS or text[:1].isspace():
            return ""
        return text[:min(_start(text, s) for s in CALL_STARTS[self.names[0]])].rstrip()

    def parse(self, text: str) -> Parsed:
        reasoning, content = self._split_reasoning(text)
        if self.tool is None:
            return Parsed(reasoning, content)
        info = self.tool.extract_tool_calls(content, self.request)
        found = info.tool_calls if info.tools_called else []
        calls = [c for c in map(_call, found) if c is not None]
        begun = max(len(found), content.count(self.marker) if self.marker else 0)
        return Parsed(reasoning, (info.content or "").strip() if calls else content, calls,
                      begun - len(calls))
