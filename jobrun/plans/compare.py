"""Comparisons of a number with a string, found before the job runs.

`lt: {in: [loss, target]}` with `target` a string fails only when the job reaches it
(Python cannot order a float and a str), and `eq` of the two is silently never true. The
kinds of value some blobs hold are known without running anything: a literal input is a
number, a `const` holds its value (vars are substituted by then), comparisons and logic
give booleans, a loop index is an integer. A comparison whose two sides are known to be
a number and a string is an error; an ordering against a string that reads as a number
(`"1e-4"`, quoted) is a warning even when the other side is not known, since it can only
hold if that side is a string too.

The same knowledge judges a loop count read from a blob: a `const` that gives it a
negative, fractional, boolean or string value stops the job when the loop starts.

What a blob holds is judged over every definition of it on its node: a blob is of a known
kind only when all of them agree, so no path through the plan is assumed. The analyzer's
walk (:mod:`jobrun.plans.analyze`) feeds :class:`Kinds` as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.scalars import kind_of, parse_number
from jobrun.plans.visit import Visitor

COMPARISONS = frozenset({"ge", "gt", "le", "lt", "eq", "ne"})
_ORDERINGS = frozenset({"ge", "gt", "le", "lt"})
_BOOLEAN_OPS = COMPARISONS | {"and", "or", "not"}
_RECORDED = _BOOLEAN_OPS | {"const"}  # the ops whose first output's kind is known
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
    code: str = "compare-types"


class Kinds:
    """Fed the op calls and loop indexes of the analyzer's walk (one walk for all checks);
    `findings()` then judges the comparisons met.

    The walk keeps only the calls whose outputs have a known kind (const, comparisons,
    logic): a call per op would cost the walk of a big plan a third more. Whether some
    other op also defines a compared blob is asked of the plan only for a comparison that
    would otherwise be reported, which is rare."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ir.OpCall]] = []  # (node, call) of the recorded ops
        self.indexes: list[tuple[str, ir.BlobRef]] = []  # (node, loop `as` blob)
        self.counts: list[tuple[str, ir.BlobRef]] = []  # (node, blob a loop count reads)

    def op(self, node: str, call: ir.OpCall) -> None:
        if call.op in _RECORDED:
            self.calls.append((node, call))

    def index(self, node: str, ref: ir.BlobRef) -> None:
        self.indexes.append((node, ref))

    def count(self, node: str, ref: ir.BlobRef) -> None:
        self.counts.append((node, ref))

    def findings(self, plan: ir.Plan) -> list[Finding]:
        """Every comparison of a number with a string whose kinds are known statically,
        then every loop count that only `const`s give, one of them no count."""
        return self._comparisons(plan) + self._counts(plan)

    def _counts(self, plan: ir.Plan) -> list[Finding]:
        wanted = {(node, ref.name) for node, ref in self.counts}
        if not wanted:
            return []
        sides: dict[tuple[str, str], list[Side]] = {}
        for key, side in _every_definition(plan, wanted, self._known(wanted)):
            sides.setdefault(key, []).append(side)
        found = []
        for node, ref in self.counts:
            defs = sides.get((node, ref.name), [])
            if not defs or any(d.source is None for d in defs):
                continue  # another op (or a loop index) defines it too: its value is not known
            bad = [d for d in defs if not _whole(d.value)]
            if bad:
                line = bad[0].source.line if bad[0].source is not None else 0
                found.append(Finding(
                    "error" if len(bad) == len(defs) else "warning", ref.pos,
                    f"loop count {bad[0].text} is not a whole number >= 0: the job stops when the "
                    "loop starts",
                    f"give the `const` at line {line} a whole number >= 0, e.g. value: 3", "loop-count",
                ))
        return found

    def _comparisons(self, plan: ir.Plan) -> list[Finding]:
        comparisons = [(node, c) for node, c in self.calls if c.op in COMPARISONS and len(c.ins) == 2]
        wanted = {(node, i.name) for node, c in comparisons for i in c.ins if isinstance(i, ir.BlobRef)}
        if not wanted:
            return []
        defs = _agreed(self._known(wanted))
        found = self._judged(comparisons, defs)
        if found:  # now with every definition of those blobs, whatever op made it
            suspects = {(node, i.name) for node, c, _ in found for i in c.ins if isinstance(i, ir.BlobRef)}
            defs = _agreed(_every_definition(plan, suspects, self._known(suspects)))
            found = self._judged([(node, c) for node, c, _ in found], defs)
        return [finding for _, _, finding in found]

    def _known(self, wanted: set[tuple[str, str]]) -> list[tuple[tuple[str, str], Side]]:
        """The recorded definitions of the `wanted` blobs, with what each gives."""
        out = [((node, o.name), _defined(call, i, o)) for node, call in self.calls
               for i, o in enumerate(call.outs) if (node, o.name) in wanted]
        out += [((node, ref.name), Side(NUMBER, f"`{ref.name}` (a loop index)", ref.pos))
                for node, ref in self.indexes if (node, ref.name) in wanted]
        return out

    def _judged(
        self, comparisons: list[tuple[str, ir.OpCall]], defs: dict[tuple[str, str], Side]
    ) -> list[tuple[str, ir.OpCall, Finding]]:
        found = []
        for node, call in comparisons:
            a, b = (_side(defs, node, item) for item in call.ins)
            finding = _judge(call, a, b) or _judge(call, b, a)
            if finding is not None:
                found.append((node, call, finding))
        return found


def _agreed(definitions: list[tuple[tuple[str, str], Side]]) -> dict[tuple[str, str], Side]:
    """(node, blob) -> what all its definitions agree on, or _UNKNOWN."""
    defs: dict[tuple[str, str], Side] = {}
    for key, side in definitions:
        first = defs.setdefault(key, side)
        if first is not side and first.kind != side.kind:
            defs[key] = _UNKNOWN
    return defs


def _every_definition(
    plan: ir.Plan, wanted: set[tuple[str, str]], known: list[tuple[tuple[str, str], Side]]
) -> list[tuple[tuple[str, str], Side]]:
    """The known definitions of `wanted`, plus an unknown one for every other op that
    defines one of them."""
    walk = _Outputs(wanted)
    walk.visit(plan)
    seen = {(key, side.pos) for key, side in known}
    return known + [
        (key, _UNKNOWN) for key, pos in walk.found if (key, pos) not in seen
    ]


class _Outputs(Visitor):
    """Where each of some blobs is defined (by any op), per node."""

    def __init__(self, wanted: set[tuple[str, str]]):
        self.wanted = wanted
        self.found: list[tuple[tuple[str, str], Pos]] = []
        self.node = "local"

    def visit_Task(self, task: ir.Task) -> None:
        self.node = task.node
        self.generic_visit(task)

    def visit_OpCall(self, call: ir.OpCall) -> None:
        for out in call.outs:
            if (self.node, out.name) in self.wanted:
                self.found.append(((self.node, out.name), out.pos))


def _side(defs: dict[tuple[str, str], Side], node: str, item: ir.Input) -> Side:
    if isinstance(item, ir.Literal):
        return Side(NUMBER, kind_of(item.value), item.pos, item.value, item.pos)
    first = defs.get((node, item.name), _UNKNOWN)
    if first.kind is None:
        return Side(None, f"`{item.name}`", item.pos)
    # Placed at the read; named by the definition, which says where the kind comes from.
    return Side(first.kind, first.text, item.pos, first.value, first.source)


def _defined(call: ir.OpCall, i: int, out: ir.BlobRef) -> Side:
    """What output `i` of `call` holds, as far as is known without running it."""
    if i == 0 and call.op == "const":
        value = call.kwargs.get("value")
        source = call.pos_of("value")  # a null or a list too: a loop count judges them
        return Side(_kind(value), f"`{out.name}` ({kind_of(value)}, line {source.line})", out.pos, value, source)
    elif i == 0 and call.op in _BOOLEAN_OPS:
        return Side(NUMBER, f"`{out.name}` (a boolean from `{call.op}`, line {out.pos.line})", out.pos)
    return _UNKNOWN


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


def _whole(value: Any) -> bool:
    """Whether a const's value is a loop count: a whole number >= 0, or a list of one
    (a one-element tensor)."""
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: Any) -> str | None:
    if isinstance(value, bool | int | float):
        return NUMBER  # a bool orders and compares with numbers as 0 and 1
    if isinstance(value, str):
        return STRING
    return None  # null, or a list (a tensor): not judged


_UNKNOWN = Side(None, "", Pos("<unknown>"))
