"""Arithmetic in `${...}`: `${steps - warmup}`, `${batch * 2}`, `${(a + b) // 2}`.

Parsed with :mod:`ast` and evaluated by walking a whitelist of node types: numbers,
names of vars, `+ - * / // %`, unary minus and plus, parentheses. Nothing is ever
evaluated by Python itself (no ``eval``), and a var's value must be a number. Types are
Python's: int op int stays int, except `/`, which gives a float.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from jobrun.plans.scalars import kind_of

MAX_EXPR = 200  # characters: longer is no plan's arithmetic, and bounds the parser's work
MAX_INT_BITS = 256  # an int result past this is a mistake, not a size or a rate

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%"}

HINT = "${...} holds a var name or arithmetic on vars and numbers: + - * / // % and ( )"


class ArithError(ValueError):
    """What is wrong with an expression; the caller adds where it is written."""

    def __init__(self, message: str, hint: str = HINT) -> None:
        super().__init__(message)
        self.hint = hint


def evaluate(text: str, lookup: Callable[[str], Any]) -> int | float:
    """The value of `text`; `lookup(name)` gives a var's value (or raises)."""
    if len(text) > MAX_EXPR:
        raise ArithError(f"${{...}} of {len(text)} characters is too long (at most {MAX_EXPR})",
                         "compute a part in a var of its own")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ArithError(f"cannot read ${{{text.strip()}}} as arithmetic") from None
    return _eval(tree.body, lookup, text.strip())


def _eval(node: ast.AST, lookup: Callable[[str], Any], text: str) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ArithError(f"${{{text}}}: {node.value!r} is not a number")
        return node.value
    if isinstance(node, ast.Name):
        value = lookup(node.id)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ArithError(
                f"${{{text}}}: var {node.id!r} is {kind_of(value)}, not a number",
                "arithmetic works on vars that hold numbers",
            )
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, lookup, text))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval(node.left, lookup, text)
        right = _eval(node.right, lookup, text)
        if right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
            raise ArithError(f"${{{text}}} divides by zero ({_SYMBOL[type(node.op)]} 0)",
                             "check the vars it uses")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise ArithError(f"${{{text}}} gives an integer of {result.bit_length()} bits",
                             "check the vars it uses")
        if isinstance(result, float) and not math.isfinite(result):
            raise ArithError(f"${{{text}}} gives {result}", "check the vars it uses")
        return result
    raise ArithError(f"${{{text}}}: {_describe(node)} is not allowed here")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return f"the operator {type(node.op).__name__}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return "an attribute"
    return f"a {type(node).__name__}"
