"""Tools for the built-in tool-use task and the examples: schemas, implementations, scoring.

Each tool is an OpenAI function schema (shown to the model by its chat template) and a plain
function that never raises: bad input comes back as an "error: ..." string, which the model
reads as the tool's result. Agent-facing: stdlib only.
"""

import ast
import operator
from typing import Any

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a fact, e.g. 'population of Avalon'",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+, -, *, / on numbers; anything else is an error message, not an exception."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")
    try:
        value = ev(ast.parse(str(expression), mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value) if float(value).is_integer() else round(value, 6))


def lookup(key: str, facts: dict[str, Any]) -> str:
    """The value stored under `key` (case and surrounding spaces ignored), or an error."""
    wanted = str(key).strip().lower()
    for name, value in facts.items():
        if name.lower() == wanted:
            return str(value)
    return f"error: no entry for {str(key)[:60]!r}"


def call_tool(call: dict[str, Any], facts: dict[str, Any]) -> str:
    """Run one parsed call `{"name": ..., "arguments": {...}}`; `facts` back the lookup tool."""
    args = call.get("arguments")
    args = args if isinstance(args, dict) else {}
    if call.get("name") == "calculator":
        return calculate(args.get("expression", ""))
    if call.get("name") == "lookup":
        return lookup(args.get("key", ""), facts)
    return f"error: unknown tool {str(call.get('name'))[:40]!r}"


def score(text: str, label) -> float:
    """1.0 if the last number in the answer equals the label."""
    numbers = [w.strip(".,!?") for w in str(text).split()]
    numbers = [n for n in numbers if n.lstrip("-").replace(".", "", 1).isdigit()]
    return float(bool(numbers) and float(numbers[-1]) == float(label))
