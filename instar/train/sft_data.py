"""Data for `instar sft`: chat JSONL, assistant-only loss masks read off the chat template,
and a small built-in data set for the default model.

How a conversation becomes (ids, mask), for each assistant message i:

    render(messages[:i], generation prompt)  ->  text up to where turn i's content starts
    render(messages[:i + 1])                 ->  text up to where turn i ends
    render(messages)                         ->  the whole conversation

    |<|im_start|>system ...<|im_start|>user\\nWhat is 2+3?<|im_end|>\\n<|im_start|>assistant\\n|
    |<tool_call>{...}</tool_call><|im_end|>|\\n<|im_start|>tool\\n<tool_response>5</tool_response>...
     '------------- learned ------------'  '-- not learned: the next piece begins here --'

Each of the first two must be a prefix of the next (the template only appends); otherwise
the template rewrites earlier turns and the conversation is refused. A learned span ends
with the end-of-turn token (the tokenizer's eos token, the last one in the turn); text the
template writes after it (ChatML's newline) belongs to the next, unlearned piece. Where the
turn contains no eos token, the span is the turn with its trailing whitespace removed.

The pieces are tokenised one by one, as the Env loop sees them (`prompt_ids`, then the
generated tokens, then `continuation_ids`), so an SFT sequence is token for token what a
rollout generating the same assistant text would be.
"""

import json
import operator
import random
from pathlib import Path
from typing import Any

from instar.agents.chat import Message, render
from instar.tasks.reverse_data import reverse_data
from instar.tasks.tiny_model import cache_root, write_rows
from instar.tasks.tools import CALCULATOR


def _turn_end(tokenizer, turn: str, start: int) -> int:
    """Where the learned span of an assistant turn rendered as `turn[start:]` ends."""
    eos = tokenizer.eos_token
    if eos and eos in turn[start:]:
        return turn.rindex(eos) + len(eos)
    return len(turn.rstrip())


def assistant_mask(tokenizer, messages: list[Message], tools: list[dict] | None = None,
                   last_only: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and a mask, True on the tokens to learn.

    The mask covers each assistant message's content and tool calls and its end-of-turn
    token; role headers and system, user and tool messages are never learned, nor is an
    assistant message with `"weight": 0` (OpenAI's fine-tuning format: e.g. a wrong attempt
    the conversation goes on to correct, kept as context). With
    `last_only`, only the last assistant message is learned (for templates that render a
    past turn differently, e.g. without its reasoning: give one row per assistant turn).
    Raises ValueError, naming the message, where the template rewrites earlier turns.
    """
    full = render(tokenizer, messages, tools, False)
    turns = [i for i, m in enumerate(messages)
             if m.get("role") == "assistant" and m.get("weight", 1)]
    cuts, pos = [0], 0  # char offsets where learned and unlearned pieces alternate
    for i in turns[-1:] if last_only else turns:
        head = render(tokenizer, messages[:i], tools, True)
        turn = render(tokenizer, messages[:i + 1], tools, False)
        if not (turn.startswith(head) and full.startswith(turn) and len(head) >= pos):
            raise ValueError(
                f"message {i}: the chat template renders the conversation up to this assistant "
                "turn differently inside the whole conversation (it rewrites earlier turns, "
                "e.g. drops past reasoning), so one sequence cannot train every assistant turn; "
                "learn only the last turn (last_only) with one row per assistant turn")
        pos = _turn_end(tokenizer, turn, len(head))
        cuts += [len(head), pos]
    cuts.append(len(full))
    ids: list[int] = []
    mask: list[bool] = []
    for k in range(len(cuts) - 1):
        piece = tokenizer.encode(full[cuts[k]:cuts[k + 1]], add_special_tokens=False)
        ids += piece
        mask += [k % 2 == 1] * len(piece)
    return ids, mask


def load_sft_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows `{"messages": [...], "tools": [...]}` (`tools` optional; other keys kept).

    Raises ValueError naming file:line for a row that is not a JSON object with a non-empty
    `messages` list of role-tagged messages including an assistant one.
    """
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            messages = row.get("messages") if isinstance(row, dict) else None
            if not isinstance(messages, list) or not messages:
                raise ValueError(f'{where}: expected an object with a non-empty "messages" list')
            for j, m in enumerate(messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
                    raise ValueError(f'{where}: message {j} is not an object with a "role"')
                if m.get("weight", 1) not in (0, 1) or "weight" in m and m["role"] != "assistant":
                    raise ValueError(f'{where}: message {j}: "weight" is 0 or 1, on an assistant '
                                     "message (0: kept as context, not learned)")
            if not any(m["role"] == "assistant" and m.get("weight", 1) for m in messages):
                raise ValueError(f"{where}: no assistant message (of weight 1), so nothing to "
                                 "learn")
            tools = row.get("tools")
            if tools is not None and not (isinstance(tools, list)
                                          and all(isinstance(t, dict) for t in tools)):
                raise ValueError(f'{where}: "tools" must be a list of objects')
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _call(expression: str) -> Message:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator",
                                          "arguments": {"expression": expression}}}]}


def _calculator_row(rng: random.Random) -> dict:
    """A user asks for arithmetic; the assistant calls the calculator, then answers; half
    the rows go on with a follow-up question on the previous result."""
    a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
    if op == "*":
        b = rng.randint(2, 12)
    expr, value = f"{a}{op}{b}", _OPS[op](a, b)
    ask = rng.choice(["What is {}?", "Compute {}.", "Please calculate {}."]).format(expr)
    messages: list[Message] = [{"role": "system", "content": "Use the calculator for arithmetic."}]
    messages = messages if rng.random() < 0.5 else []
    messages += [{"role": "user", "content": ask}, _call(expr),
                 {"role": "tool", "content": str(value)},
                 {"role": "assistant", "content": f"The answer is {value}."}]
    if rng.random() < 0.5:
        c, op = rng.randint(2, 9), rng.choice("+*")
        expr, value = f"{value}{op}{c}", _OPS[op](value, c)
        ask = f"Now add {c}." if op == "+" else f"Now multiply that by {c}."
        messages += [{"role": "user", "content": ask}, _call(expr),
                     {"role": "tool", "content": str(value)},
                     {"role": "assistant", "content": f"The answer is {value}."}]
    return {"messages": messages, "tools": [CALCULATOR]}


def builtin_sft_data(n_reverse: int = 2000, n_calculator: int = 1000) -> Path:
    """Path of the built-in SFT JSONL (written once into the cache, deterministic): the
    reverse task ("Reverse: abcd" -> "dcba", from its train split, never its eval strings)
    and calculator conversations with tool calls and follow-up turns, shuffled together."""
    path = cache_root() / "data" / f"sft-v1-{n_reverse}-{n_calculator}" / "train.jsonl"
    if not path.exists():
        with open(reverse_data()[0]) as f:
            reverse = [json.loads(line) for line in f.readlines()[:n_reverse]]
        rng = random.Random(0)
        rows = [{"messages": [{"role": "user", "content": r["prompt"]},
                              {"role": "assistant", "content": r["label"]}]} for r in reverse]
        rows += [_calculator_row(rng) for _ in range(n_calculator)]
        rng.shuffle(rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_rows(path, rows)
    return path
