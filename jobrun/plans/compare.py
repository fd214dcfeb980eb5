"""Comparisons of a number with a string, found before the job runs.

`lt: {in: [loss, target]}` with `target` a string fails only when the job reaches it
(Python cannot order a float and a str), and `eq` of the two is silently never true. The
kinds of value some blobs hold are known without running anything: a literal input is a
number, a `const` holds its value (vars are substituted by then), comparisons and logic
give booleans, a loop index is an integer. A comparison whose two sides are known to be
a number and a string is an error; an ordering against a string that reads as a number
(`"1e-4"`, quoted) is a warning even when the other side is not known, since it can only
hold if that side is a string too.

What a blob holds is judged over every definition of it on its node: a blob is of a known
kind only when all of them agree, so no path through the plan is assumed. The analyzer's
walk (:mod:`jobrun.plans.analyze`) feeds :class:`Kinds` as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.load import kind_of, parse_number

COMPARISONS = frozenset({"ge", "gt", "le", "lt", "eq", "ne"})
_ORDERINGS = frozenset({"ge", "gt", "le", "lt"})
_BOOLEAN_OPS = COMPARISONS | {"and", "or", "not"}
NUMBER, STRING = "number", "string"


@dataclass(frozen=True)
class Side:
    """What is known of one value: its kind (None: unknown), how to name it in a
    message, where it was written, and the value itself when a plan wrote it."""

    kind: str | None
    text: str
    pos: Pos
    value: Any = None
    source: Pos | None = None  # where the value was written (a const's `value`)


@dataclass(frozen=True)
class Finding:
    severity: str
    pos: Pos
    message: str
    hint: str


class Kinds:
    """Fed every op call and loop index by the analyzer's walk (one walk for all checks);
    `findings()` then judges the comparisons met."""

    def __init__(self) -> None:
        # (node, blob) -> what its definitions agree on, or _UNKNOWN
        self.defs: dict[tuple[str, str], Side] = {}
        self.comparisons: list[tuple[str, ir.OpCall]] = []

    def op(self, node: str, call: ir.OpCall) -> None:
        name = call.op
        if name in COMPARISONS and len(call.ins) == 2:
            self.comparisons.append((node, call))
        for i, out in enumerate(call.outs):
            side = _UNKNOWN
            if i == 0 and name == "const":
                value = call.kwargs.get("value")
                kind = _kind(value)
                if kind is not None:
                    source = call.pos_of("value")
                    side = Side(kind, f"`{out.name}` ({kind_of(value)}, line {source.line})",
                                out.pos, value, source)
            elif i == 0 and name in _BOOLEAN_OPS:
                side = Side(NUMBER, f"`{out.name}` (a boolean from `{name}`, line {out.pos.line})", out.pos)
            self._define(node, out.name, side)

    def index(self, node: str, ref: ir.BlobRef) -> None:
        self._define(node, ref.name, Side(NUMBER, f"`{ref.name}` (a loop index)", ref.pos))

    def _define(self, node: str, name: str, side: Side) -> None:
        key = (node, name)
        first = self.defs.setdefault(key, side)
        if first is not side and first.kind != side.kind:
            self.defs[key] = _UNKNOWN

    def findings(self) -> list[Finding]:
        """Every comparison of a number with a string whose kinds are known statically."""
        found = []
        for node, call in self.comparisons:
            a, b = (self._side(node, item) for item in call.ins)
            finding = _judge(call, a, b) or _judge(call, b, a)
            if finding is not None:
                found.append(finding)
        return found

    def _side(self, node: str, item: ir.Input) -> Side:
        if isinstance(item, ir.Literal):
            return Side(NUMBER, kind_of(item.value), item.pos, item.value, item.pos)
        first = self.defs.get((node, item.name), _UNKNOWN)
        if first.kind is None:
            return Side(None, f"`{item.name}`", item.pos)
        # Placed at the read; named by the definition, which says where the kind comes from.
        return Side(first.kind, first.text, item.pos, first.value, first.source)


def _judge(call: ir.OpCall, num: Side, text: Side) -> Finding | None:
    """A finding when `text` is a string and `num` a number (or unknown, for an
    ordering against a string that reads as a number)."""
    if text.kind != STRING:
        return None
    looks_numeric = isinstance(parse_number(text.value), int | float)
    if num.kind == NUMBER:
        severity = "error"
    elif num.kind is None and looks_numeric and call.op in _ORDERINGS:
        severity = "warning"
    else:
        return None
    consequence = ("they are never equal" if call.op == "eq" else "they are always unequal"
                   if call.op == "ne" else "a number and a string cannot be ordered")
    if num.kind is None:
        consequence = f"if {num.text} holds a number, {consequence}"
    if looks_numeric:
        where = text.source or text.pos
        hint = (f"{text.value} is quoted, so it is a string: write it without quotes (line "
                f"{where.line}, column {where.col}, or in the var that gives it)")
    elif num.kind == NUMBER and num.source is not None and num.source != num.pos:
        hint = (f"quote the value at line {num.source.line} if you meant strings, or give "
                f"{text.text} a number")
    else:
        hint = f"`{call.op}` needs two numbers or two strings: give {text.text} a number"
    return Finding(
        severity, text.pos,
        f"`{call.op}` compares {num.text} with {text.text}: {consequence}", hint,
    )


def _kind(value: Any) -> str | None:
    if isinstance(value, bool | int | float):
        return NUMBER  # a bool orders and compares with numbers as 0 and 1
    if isinstance(value, str):
        return STRING
    return None  # null, or a list (a tensor): not judged


_UNKNOWN = Side(None, "", Pos("<unknown>"))
