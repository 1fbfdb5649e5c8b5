"""The calculator tool shared by the examples: its schema and a safe evaluator."""

import ast
import operator

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

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


def score(text: str, label) -> float:
    """1.0 if the last number in the answer equals the label."""
    numbers = [w.strip(".,!?") for w in str(text).split()]
    numbers = [n for n in numbers if n.lstrip("-").replace(".", "", 1).isdigit()]
    return float(bool(numbers) and float(numbers[-1]) == float(label))
