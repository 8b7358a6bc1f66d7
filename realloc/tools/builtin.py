"""The tools realloc ships, for ``ToolEnv`` (``realloc/envs/tool_env.py``): ``tool(text) -> str | None``.

They run inside the sandbox's child process (``sandbox.py``), never in the training process.

- ``calculator``: integer and decimal arithmetic (``+ - * / // % **``, parentheses, unary minus) by walking the
  expression's syntax tree; nothing is evaluated as code. Exponents are bounded so that one call stays small.
- ``python``: runs the text as a Python program; the observation is what it prints (and its error, if any).
"""

from __future__ import annotations

import ast
import operator
# Modules a program of the python tool may import: loaded here, before the child gives up root (see child.py).
import bisect, collections, datetime, decimal, fractions, functools, heapq, itertools, json, math, random, re  # noqa: E401,F401
import statistics, string  # noqa: E401,F401

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
MAX_LENGTH = 200


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text: ``calculate("123*45") == "5535"``; whole-number results
    of a division are written without ``.0``. Raises ValueError on anything but arithmetic."""
    text = expression.strip()
    if len(text) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text!r}") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return str(value)


def calculator(text: str) -> str:
    return calculate(text)


def python(text: str) -> None:
    """Run ``text`` as a program in a fresh namespace; what it prints is the observation."""
    exec(compile(text, "<tool>", "exec"), {"__name__": "__main__"})  # noqa: S102  (the sandbox is the boundary)


BUILTIN_TOOLS = {"calculator": "realloc.tools.builtin:calculator", "python": "realloc.tools.builtin:python"}
