"""`instar check-model DIR`: whether a checkpoint's tokenizer and chat template suit instar.

    instar check-model DIR [--model.tool-parser NAME] [--model.reasoning-parser NAME]

Loads the tokenizer and config.json only (no weights, no engine) and runs instar's own
rendering (instar/agents/chat.py) and parsers (instar/rollout/parsers.py) on scripted
conversations (a question, a tool call and its result, an answer, a follow-up, a thank-you):

1. turns: the generation prompt, the token that ends an assistant turn (instar continues a
   conversation after the tokenizer's eos_token) and the tokens the engine stops at;
2. prefix stability: every next turn is appended after the tokens of the last, as the Env
   loop appends it (the reply's raw text) and as the gateway does (the reply as a message),
   with and without tools and reasoning; a template that renders an earlier turn differently
   is shown where the two renders part;
3. tool calls: a call as the template writes it into history parses back into the same call
   with the run's tool parser (and reasoning with the reasoning parser);
4. control tokens: message text holding the strings of the template's added tokens stays text;
5. reasoning in history: kept, never written, or dropped from earlier turns.

Then it says which instar features are safe with the model (Env continuation, gateway capture
in one segment, MoE routing replay) and exits 1 when a problem blocks training, else 0.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from instar.agents.chat import Message, canonical, continuation_ids, encode, prompt_ids, render

OK, WARN, BLOCK = "ok", "warn", "block"


@dataclass(frozen=True, slots=True)
class Finding:
    """A line of the report. Example: Finding("tool calls", "block", "hermes reads no call")."""

    check: str
    """What was checked: "tool calls", "Env continuation", ..."""
    level: str
    """ok, warn (works, with a limit worth knowing) or block (instar cannot train this way)."""
    text: str
    """What was found, with the template's own text where it matters."""


@dataclass
class ParserFlags:
    tool_parser: str = ""
    """As `instar rl --model.tool-parser`: a vLLM tool parser. Empty: detected from the chat
    template."""
    reasoning_parser: str = ""
    """As `instar rl --model.reasoning-parser`. Empty: detected from the chat template."""


@dataclass
class CheckModel:
    dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="DIR")]
    """A Hugging Face checkpoint folder (config.json, the tokenizer and its chat template; the
    weights are not read), or a Hub id (org/name), fetched without its weights."""
    model: ParserFlags = field(default_factory=ParserFlags)


ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"]}}}
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
"""The call as a parser returns it (and as the gateway keeps it: `canonical`)."""
CALLED = {"type": "function", "function": CALL}
"""The call as Hugging Face chat templates expect it in a message."""
QUESTION = {"role": "user", "content": "What is 2+3?"}
THOUGHT = "2 and 3 make 5."


def reply(content: str, thought: str | None = None, calls: list | None = None) -> Message:
    m = {"role": "assistant", "content": content}
    return {**m, **({"reasoning_content": thought} if thought else {}),
            **({"tool_calls": calls} if calls else {})}


def conversation(tools: bool, reasoning: bool) -> list[Message]:
    """The scripted episode."""
    think = (lambda text: text) if reasoning else (lambda text: None)
    call = [reply("Let me work it out.", think("I should call add."), [CALLED]),
            {"role": "tool", "content": "5"}] if tools else []
    return [QUESTION, *call, reply("The sum is 5.", think(THOUGHT)),
            {"role": "user", "content": "And 3+4?"}, reply("7.", think("3 and 4 make 7.")),
            {"role": "user", "content": "Thanks."}]


def shared(tok, a: str, b: str) -> int:
    """The length of the start `a` and `b` share, not ending inside an added token's string."""
    i = len(os.path.commonprefix([a, b]))
    for token in tok.get_added_vocab():
        for text in (a, b):
            start = text.rfind(token, 0, i + len(token) - 1)  # (the last that starts before i)
            if start >= 0 and start + len(token) > i:
                i = start
    return i


def generation_prompt(tok, messages: list[Message], tools: list | None) -> str:
    """What the template adds after `messages` for the assistant to answer."""
    prompt = render(tok, messages, tools, True)
    return prompt[shared(tok, render(tok, messages, tools, False), prompt):]


def reply_text(tok, before: list[Message], message: Message, tools: list | None) -> str:
    """What the model generates for `message` after `before`: the template's text of it as the
    last turn, from the end of the generation prompt to the end-of-turn token."""
    cue = generation_prompt(tok, before, tools)  # e.g. "<|im_start|>assistant\n"
    full = render(tok, before + [message], tools, False)
    start = full.rindex(cue) + len(cue) if cue and cue in full else \
        shared(tok, render(tok, before, tools, True), full)  # (no cue, or unlike history's)
    return full[start:].split(tok.eos_token)[0]


def parting(old: str, new: str) -> str:
    i = len(os.path.commonprefix([old, new]))
    return f"{old[max(0, i - 24):i + 24]!r} becomes {new[max(0, i - 24):i + 24]!r}"


def appended(tok, messages: list[Message], tools: list | None, env: bool
             ) -> tuple[str | None, int | None]:
    """Append the episode turn by turn as instar does (`env`: the Env loop's raw reply text,
    else the gateway's messages): (None when every turn extends the last, else where not;
    gateway: where its tokens part from a fresh render of the episode, None if nowhere; the
    Env loop's differ wherever the raw text holds control-token strings, kept literal)."""
    messages = messages if env else [canonical(m) for m in messages]  # (as the gateway keeps them)
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    history = messages[:starts[0]]
    ids = prompt_ids(tok, history, tools)
    for turn, (i, end) in enumerate(zip(starts, starts[1:] + [len(messages)]), 1):
        text = reply_text(tok, history, messages[i], tools)
        ids += encode(tok, text) + [tok.eos_token_id]
        before = history + [{"role": "assistant", "content": text} if env else messages[i]]
        after = before + messages[i + 1:end]
        more = continuation_ids(tok, before, after, tools, True)
        if more is None:
            old, new = render(tok, before, tools, False), render(tok, after, tools, True)
            if new.startswith(old) or tok.eos_token not in old:
                return f"at turn {turn + 1} the reply's turn ends with no {tok.eos_token!r}", None
            return f"at turn {turn + 1} the history renders differently: {parting(old, new)}", None
        ids, history = ids + more, after
    fresh = ids if env else prompt_ids(tok, history, tools)
    return None, None if ids == fresh else len(os.path.commonprefix([ids, fresh]))


RAISED = "the template raised"


def safely(fn, *args):
    """`fn(*args)`, or the line a template's own error makes (templates raise anything)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (jinja's errors, a template's raise_exception, ...)
        return f"{RAISED} {type(e).__name__}: {' '.join(str(e).split())[:160]}"


SCENARIOS = {"plain": (False, False), "tools": (True, False), "reasoning": (False, True),
             "tools+reasoning": (True, True)}
"""name: (with tools, with reasoning)"""


def prefix_stability(tok) -> dict[tuple[str, str], tuple[str | None, int | None]]:
    """`appended` for each path (env, gateway) and scenario."""
    out = {(path, name): safely(appended, tok, conversation(t, r), [ADD] if t else None,
                                path == "env")
           for path in ("env", "gateway") for name, (t, r) in SCENARIOS.items()}
    return {k: (v, None) if isinstance(v, str) else v for k, v in out.items()}


def stability(stable: dict) -> Finding:
    def state(path, name):
        problem, part = stable[path, name]
        return ("stable" if not problem else "cannot render" if problem.startswith(RAISED)
                else "rewritten") + ("" if part is None else " (its tokens part from a fresh "
                                     f"render of the episode at token {part})")
    lines = [f"{label}: " + ", ".join(f"{name} {state(path, name)}" for name in SCENARIOS)
             for path, label in (("env", "Env loop"), ("gateway", "gateway"))]
    return Finding("prefix stability", WARN if any(p for p, _ in stable.values()) else OK,
                   "\n".join(lines))


def turns(tok, folder: Path) -> list[Finding]:
    """The generation prompt, the end of an assistant turn, the stop tokens."""
    from transformers import GenerationConfig

    eos = tok.eos_token
    if eos is None:
        return [Finding("end of turn", BLOCK, "the tokenizer has no eos_token: instar appends "
                        "each next turn after it")]
    out = [Finding("generation prompt", OK, repr(generation_prompt(tok, [QUESTION], None)))]
    full = render(tok, [QUESTION, reply("The sum is 5.")], None, False)
    end = full[full.rindex("The sum is 5.") + len("The sum is 5."):]
    if end.split(eos)[0].strip() or eos not in end:
        out.append(Finding("end of turn", BLOCK, f"an assistant turn ends with {end[:24]!r}, "
                           f"not the tokenizer's eos_token {eos!r}, after which instar appends "
                           "the next turn: set eos_token to the end-of-turn token"))
    else:
        out.append(Finding("end of turn", OK, f"assistant turns end with {eos!r} (eos_token, id "
                           f"{tok.eos_token_id})"))
    try:
        stops = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:  # (no generation_config.json)
        stops = None
    stops = sorted({tok.eos_token_id, *([stops] if isinstance(stops, int) else stops or [])})
    names = tok.convert_ids_to_tokens(stops)
    out.append(Finding("stop tokens", OK, f"the engine stops at {', '.join(map(repr, names))}"
                       + ("" if len(stops) == 1 else f" (after a reply that ends with another "
                          f"of them, instar appends {eos!r} before the next turn)")))
    return out


def round_trip(tok, parsers) -> list[Finding]:
    """A tool call and reasoning as the template writes them, read back by the run's parsers."""
    tool, reasoning = parsers.names
    out = []
    if parsers.tool is None:
        out.append(Finding("tool calls", WARN, "no tool parser (none): replies' calls are not "
                           "parsed"))
    else:
        text = reply_text(tok, [QUESTION], reply("Let me work it out.", None, [CALLED]), [ADD])
        got = parsers.parse(text)
        loose = [(c["name"], {k: str(v) for k, v in c["arguments"].items()})
                 for c in got.tool_calls]
        out.append(Finding("tool calls", OK, f"{tool} reads back the call the template writes, "
                           f"{text!r}") if got.tool_calls == [CALL] else Finding(
            "tool calls", WARN, f"{tool} reads back the call the template writes ({text!r}) but "
            f"its arguments as {got.tool_calls[0]['arguments']}: their JSON types are lost")
            if loose == [("add", {"a": "2", "b": "3"})] else Finding(
            "tool calls", WARN, f"the template writes no tool call into history ({text!r}): the "
            "model has no tool-call format") if "add" not in text else Finding(
            "tool calls", BLOCK, f"the template writes a call as {text!r}; the tool parser "
            f"{tool} reads {got.tool_calls or 'no call'}" + (
                f" ({got.tool_call_errors} begun that did not parse)" if got.tool_call_errors
                else "") + ": set --model.tool-parser to the template's format"))
    text = reply_text(tok, [QUESTION], reply("The sum is 5.", THOUGHT), None)
    if THOUGHT not in text:  # (the template writes no reasoning: "reasoning in history")
        return out
    if parsers.reasoning is None:
        out.append(Finding("reasoning", WARN, f"the template writes reasoning ({text!r}) but "
                           "no reasoning parser is set: it stays in the reply's text"))
        return out
    got = parsers.parse(text)
    fine = (got.reasoning or "").strip() == THOUGHT and got.content.strip() == "The sum is 5."
    out.append(Finding("reasoning", OK if fine else WARN, f"{reasoning} " + (
        "reads back the reasoning the template writes" if fine else
        f"reads {text!r} as reasoning {got.reasoning!r} and reply {got.content!r}")))
    return out


def control_tokens(tok) -> Finding:
    """Text holding the strings of the added tokens the template writes, in a user message and
    a tool result (ending with a newline, as tool output often does), against the same episode
    with plain text."""
    script = conversation(True, True)
    sample = render(tok, script, [ADD], True) + render(tok, script[:-1], [ADD], False)
    marks = sorted(s for s in tok.get_added_vocab() if s in sample)
    if not marks:
        return Finding("control tokens", OK, "the template writes no added token")
    text = " ".join(marks) + "\n"
    made = [t for t in tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))
            if t in marks]
    episode = lambda s: [{"role": "user", "content": s}, reply("", None, [CALLED]),  # noqa: E731
                         {"role": "tool", "content": s}]
    try:
        hostile, plain = (prompt_ids(tok, episode(s), [ADD]) for s in (text, "x\n"))
    except ValueError as e:
        return Finding("control tokens", WARN, f"instar's literal rendering does not apply ({e}): "
                       f"an episode with a message such as {text!r} fails")
    ids = tok.convert_tokens_to_ids(marks)
    leaked = [m for m, i in zip(marks, ids) if hostile.count(i) > plain.count(i)]
    if leaked:
        return Finding("control tokens", BLOCK, f"message text becomes the control tokens "
                       f"{leaked}")
    return Finding("control tokens", OK, f"plain tokenisation makes {len(set(made))} control "
                   f"tokens of {text!r}; in messages, instar's literal rendering keeps it text")


def reasoning_history(tok) -> Finding:
    """Whether reasoning written in the last turn is still there once another turn follows."""
    if THOUGHT not in render(tok, [QUESTION, reply("The sum is 5.", THOUGHT)], None, False):
        return Finding("reasoning in history", OK, "the template never writes reasoning_content")
    after_user = [QUESTION, reply("The sum is 5.", THOUGHT), {"role": "user", "content": "Ok?"}]
    after_tool = [QUESTION, reply("", THOUGHT, [CALLED]), {"role": "tool", "content": "5"}]
    dropped = [where for where, msgs, tools in (("a user turn", after_user, None),
                                                ("a tool result", after_tool, [ADD]))
               if THOUGHT not in render(tok, msgs, tools, True)]
    if dropped:
        return Finding("reasoning in history", WARN, "the template drops reasoning from earlier "
                       f"turns (after {' and after '.join(dropped)})")
    return Finding("reasoning in history", OK, "kept in earlier turns")


def routers(folder: Path) -> tuple[int, int, str]:
    """(experts, Qwen3-MoE routers the trainer's replay hooks, model type) of config.json."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    experts = max(getattr(text, k, 0) or 0 for k in ("num_experts", "num_local_experts",
                                                       "n_routed_experts"))
    if not experts:
        return 0, 0, config.model_type
    import torch
    from transformers import AutoModelForCausalLM

    from instar.train.routing import RoutingReplay

    try:
        with torch.device("meta"):  # the modules, no weights
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 (an architecture transformers cannot build)
        return experts, 0, config.model_type
    return experts, RoutingReplay(model).routers, config.model_type


def features(stable: dict, moe: tuple[int, int, str]) -> list[Finding]:
    def where(path: str, names, raised: bool) -> str:
        """'plain, tools: at turn 2 ...' for the scenarios whose render raised (`raised`) or
        was rewritten, alike ones together."""
        why: dict[str, list[str]] = {}
        for name in names:
            if (p := stable[path, name][0]) and p.startswith(RAISED) == raised:
                why.setdefault(p, []).append(name)
        return "; ".join(f"{', '.join(names)}: {text}" for text, names in why.items())

    out = [stability(stable)]
    fails = where("env", ("plain", "tools"), False) or where("env", ("plain",), True)
    rewrites, raises = where("env", SCENARIOS, False), where("env", SCENARIOS, True)
    if fails:
        out.append(Finding("Env continuation", BLOCK, "unsafe: a multi-turn Env episode fails "
                           "(EpisodeError template; single-turn ones are unaffected) where "
                           + fails))
    elif rewrites or raises:
        out.append(Finding("Env continuation", WARN, "safe, but " + " and ".join(filter(None, [
            rewrites and f"an episode fails (EpisodeError template) where {rewrites}",
            raises and f"the template cannot render where {raises}"]))))
    else:
        out.append(Finding("Env continuation", OK, "safe: every turn extends the last "
                           "(with and without tools and reasoning)"))
    rewrites, raises = where("gateway", SCENARIOS, False), where("gateway", SCENARIOS, True)
    out.append(Finding(
        "gateway capture", BLOCK if where("gateway", ("plain",), True) else
        WARN if rewrites or raises else OK, "; ".join(filter(None, [
            rewrites and f"a new segment (template_rewrites_history) where {rewrites}",
            raises and f"requests fail where {raises}"]))
        or "one segment per episode: every turn extends the last"))
    experts, hooked, kind = moe
    if not experts:
        out.append(Finding("routing replay", OK, f"not needed: {kind} is not a mixture of "
                           "experts"))
    elif not hooked:
        out.append(Finding("routing replay", WARN, f"{kind} has {experts} experts but no "
                           "Qwen3-MoE router for the trainer to replay into: "
                           "--train.no-routing-replay"))
    else:
        out.append(Finding("routing replay", OK, f"{hooked} routers replay the experts the engine "
                           "recorded over each sample's tokens (GPU engines record them, CPU ones "
                           "do not); " + ("each segment's routing comes from its own last turn"
                                          if rewrites else "every turn extends the last, so the "
                                          "last turn's routing covers the earlier turns too")))
    return out


def load(spec: str, tool_parser: str, reasoning_parser: str):
    """The folder (a Hub id's cached snapshot, without weights) and its tokenizer; a bad
    folder, id or parser name is a ValueError (one line)."""
    from transformers import AutoConfig, AutoTokenizer

    from instar.hub import resolve_model
    from instar.rollout.parsers import check

    folder = resolve_model(spec, "checkpoint", weights=False)
    AutoConfig.from_pretrained(folder)  # (read again by `routers`: a bad one fails here)
    tok = AutoTokenizer.from_pretrained(folder)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{spec}: the tokenizer has no chat template")
    check(tool_parser, reasoning_parser)
    return folder, tok


def run_checks(folder: Path, tok, tool_parser: str = "", reasoning_parser: str = ""
               ) -> list[Finding]:
    """Every finding about the checkpoint, the features last."""
    from instar.rollout.parsers import Parsers

    found = safely(turns, tok, folder)
    if isinstance(found, str):  # (a plain conversation does not render: nothing else will)
        return [Finding("chat template", BLOCK, found)]
    if tok.eos_token is None:
        return found
    try:
        parsers = Parsers(tok, tool_parser, reasoning_parser)
    except ValueError as e:
        found.append(Finding("tool calls", BLOCK, str(e)))
    else:
        calls = safely(round_trip, tok, parsers)
        found += [Finding("tool calls", WARN, calls)] if isinstance(calls, str) else calls
    for fn, name in ((control_tokens, "control tokens"),
                     (reasoning_history, "reasoning in history")):
        f = safely(fn, tok)
        found.append(Finding(name, WARN, f) if isinstance(f, str) else f)
    return found + features(prefix_stability(tok), routers(folder))


def show(spec: str, findings: list[Finding]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    style = {OK: "green", WARN: "yellow", BLOCK: "bold red"}
    table = Table(title=f"instar check-model {spec}", show_lines=True)
    for column in ("check", "", "finding"):
        table.add_column(column)
    for f in findings:  # (Text: a template's "[INST]" is no markup)
        table.add_row(f.check, Text(f.level, style[f.level]), Text(f.text))
    console = Console()
    console.print(table, soft_wrap=False)
    blocking = [f.check for f in findings if f.level == BLOCK]
    console.print(f"[bold red]blocking: {', '.join(blocking)}[/]" if blocking else
                  "[green]no blocking problem[/]")
