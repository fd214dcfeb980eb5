"""Plan scalars: the numbers plans write (YAML 1.2, as Python writes them) and how a
value reads in a message. Used by the loader (:mod:`jobrun.plans.load`) and by everything
that checks values (compile, overrides, vars, comparisons); no YAML parsing here.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_INT = 2**63 - 1
_HUGE = 30  # integers and strings longer than this are shortened in messages

# Numbers (see the module doc of jobrun.plans.load). Underscores may separate digits, as in Python.
_DIGITS = r"[0-9](?:_?[0-9])*"
_INT_RE = re.compile(
    r"[-+]?(?:0|[1-9](?:_?[0-9])*|0x(?:_?[0-9a-fA-F])+|0o(?:_?[0-7])+|0b(?:_?[01])+)\Z"
)
_LEADING_ZERO_RE = re.compile(r"[-+]?0(?:_?[0-9])+\Z")
_FLOAT_RE = re.compile(
    rf"[-+]?(?:(?:{_DIGITS}\.(?:{_DIGITS})?|\.{_DIGITS})(?:[eE][-+]?{_DIGITS})?"
    rf"|{_DIGITS}[eE][-+]?{_DIGITS})\Z"
)
_INF_RE = re.compile(r"[-+]?\.(?:inf|Inf|INF)\Z")
_NAN_RE = re.compile(r"[-+]?\.(?:nan|NaN|NAN)\Z")
NUMBER_START = frozenset("0123456789+-.")


class Bad:
    """A scalar that cannot be a plan value: the error, minus its position."""

    __slots__ = ("message", "hint")

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint


def parse_number(text: str) -> int | float | None:
    """The number a plain scalar `text` reads as in a plan, or None (not a number, or one
    a plan refuses)."""
    value = number(text.strip())
    return value if isinstance(value, int | float) else None


def number(text: str) -> int | float | Bad | None:
    """The int or float `text` writes (see the module doc), a Bad for a number a plan
    cannot hold (NaN, too large, a leading zero), or None when it is no number."""
    if _INT_RE.match(text):
        try:
            value = int(text, 0)
        except ValueError:  # more digits than Python converts: far too large anyway
            value = MAX_INT + 1
        if abs(value) > MAX_INT:
            return Bad(f"integer {shorten(text)} is too large", f"use a value from {-MAX_INT} to {MAX_INT}")
        return value
    if _FLOAT_RE.match(text):
        value = float(text)
        if math.isinf(value):
            return Bad(
                f"{shorten(text)} is too large for a number (it would be infinite)",
                "write .inf (or -.inf) if you mean infinity",
            )
        return value
    if _INF_RE.match(text):
        return -math.inf if text[0] == "-" else math.inf
    if _NAN_RE.match(text):
        return Bad(
            f"{text} (not a number) cannot be a plan value: it is never equal to, less or "
            "greater than anything",
            "use a number, .inf or -.inf; quote it if you meant a string",
        )
    if _LEADING_ZERO_RE.match(text):
        sign = text[0] if text[0] in "+-" else ""
        digits = text.lstrip("+-").lstrip("0_") or "0"
        octal = f", {sign}0o{digits} for octal" if set(digits) <= set("01234567_") else ""
        return Bad(
            f"{text} is ambiguous: YAML 1.1 reads a leading zero as octal, YAML 1.2 as decimal",
            f'write {sign}{digits} for the number{octal}, or quote it ("{text}") for a string',
        )
    return None


def show(value: Any) -> str:
    """A value as a message quotes it: its repr, with long strings cut short."""
    if isinstance(value, list | dict):
        return kind_of(value)
    if isinstance(value, str) and len(value) > _HUGE:
        return repr(value[:20]) + f"...({len(value)} characters)"
    return repr(value)


def shorten(text: str) -> str:
    """`text`, cut short for a message when it is long (a number with 5000 digits)."""
    return text if len(text) <= _HUGE else text[:20] + f"...({len(text)} characters)"


def kind_of(value: Any) -> str:
    """How a value reads in a message: 'null', 'the number 3', 'a list', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}" if len(value) < 40 else "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__
