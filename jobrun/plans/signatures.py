"""Op calls checked against their signatures: the op exists, the counts of inputs and
outputs fit, and every argument is known, of the right type and of a sane value.

A leaf of the analyzer (:mod:`jobrun.plans.analyze`), which turns each problem found here
into an error diagnostic. It needs only the op specs (data, no torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from jobrun.errors import Pos, did_you_mean
from jobrun.ops.spec import LOSS_NAMES, OpSpec, arg, bounded
from jobrun.plans import ir
from jobrun.plans.keys import DURATION, EVERY_KEY

MAX_SHAPE_ELEMENTS = 2**34


class Problem(NamedTuple):
    """One way a call does not fit its op (always an error)."""

    code: str
    pos: Pos
    message: str
    hint: str


class Signatures:
    """Checks op calls against the specs in `ops` (what each op needs is worked out once)."""

    def __init__(self, ops: Mapping[str, OpSpec]):
        self.ops = ops
        self.info: dict[str, _SpecInfo] = {}

    def check(self, call: ir.OpCall) -> list[Problem]:
        """Every problem of `call`; most calls have none."""
        spec = self.ops.get(call.op)
        if spec is None:
            hint = did_you_mean(call.op, self.ops) or "run `jobrun ops` to list the ops"
            return [Problem("unknown-op", call.pos, f"unknown op {call.op!r}", hint)]
        info = self.info.get(spec.name) or self.info.setdefault(spec.name, _SpecInfo(spec))
        found: list[Problem] = []
        for bounds, n, word, code in (
            (info.ins, len(call.ins), "input", "in-count"), (info.outs, len(call.outs), "output", "out-count"),
        ):
            lo, hi = bounds
            if n < lo or (hi is not None and n > hi):
                found.append(Problem(
                    code, call.pos, f"`{call.op}` takes {_bounds_text(lo, hi, word)}, got {n}", _op_hint(spec)
                ))
        for key, value in call.args:
            problem = _check_arg(call, spec, key, value)
            if problem is not None:
                found.append(problem)
        if call.op == "train.step" and len(call.ins) == 3:
            found += _dict_batch_step(call)
        if call.op == "scheduler" and not found:
            found += _schedule(call, spec)
        if info.required:
            given = {key for key, _ in call.args}
            found += [
                Problem(
                    "missing-arg", call.pos, f"`{call.op}` needs argument `{a.name}`",
                    f"add `{a.name}: ...` ({_describe(a.type)}); {_op_hint(spec)}",
                )
                for a in info.required if a.name not in given
            ]
        return found


def _dict_batch_step(call: ir.OpCall) -> list[Problem]:
    """`train.step: {in: [model, opt, batch]}` trains on a dict batch, model(**batch),
    whose loss only the model can compute: it needs `loss: model`."""
    loss = dict(call.args).get("loss", "cross_entropy")
    if loss == "model":
        return []
    return [Problem(
        "dict-batch", call.pos_of("loss"),
        f"`train.step` with 3 inputs trains on one dict batch, model(**batch), which needs "
        f"`loss: model`; its loss is {_show(loss)} (a loss function takes (output, target))",
        "add `loss: model`, or give the targets as a fourth input: in: [model, opt, xb, yb]",
    )]


def _schedule(call: ir.OpCall, spec: OpSpec) -> list[Problem]:
    """A `scheduler`, by the op's own rules: without a target, a misspelt `warmpu` (which
    the op takes for a torch scheduler's key), steps not above warmup; with one, the
    schedule's keys given to it (`warmup: 0` too, which the op cannot tell from none)."""
    from jobrun.ops.schedule import SCHEDULE_ARGS, beside_target, problem

    given = dict(call.args)
    if given.get("target") is not None:
        found = beside_target([k for k in SCHEDULE_ARGS if k in given], str(given["target"]))
    else:
        schedule = {k: given.get(k, spec.arg(k).default) for k in SCHEDULE_ARGS}  # type: ignore[union-attr]
        found = problem(schedule, {k: v for k, v in given.items() if spec.arg(k) is None})
    if found is None:
        return []
    key, message, hint = found
    return [Problem("arg-value", call.pos_of(key) if key in given else call.pos, message, hint or _op_hint(spec))]


class _SpecInfo:
    """What every call of one op is checked against, computed once per op."""

    def __init__(self, spec: OpSpec):
        self.ins = spec.input_bounds
        self.outs = spec.output_bounds
        self.required = tuple(a for a in spec.args if a.required)


def _check_arg(call: ir.OpCall, spec: OpSpec, key: str, value: Any) -> Problem | None:
    a = spec.arg(key)
    pos = call.pos_of(key)
    if a is None and key in _PASSED_ON.get(call.op, {}):
        a = arg(key, _PASSED_ON[call.op][key])  # passed on to torch, but only as this type
    if a is None:
        if spec.extra_args:
            return None
        known = [x.name for x in spec.args]
        return Problem(
            "unknown-arg", call.key_of(key), f"`{call.op}` has no argument `{key}`",
            did_you_mean(key, [*known, EVERY_KEY])
            or (f"its arguments are: {', '.join(known)}" if known else f"`{call.op}` takes no arguments"),
        )
    if not _type_ok(value, a.type):
        return Problem(
            "arg-type", pos,
            f"argument `{key}` of `{call.op}` is {_show(value)}; expected {_describe(a.type)}",
            _type_hint(key, value, a.type),
        )
    if _mentions_shape(a.type) and _CHECKS["shape"](value):
        size = math.prod(value)
        if size > MAX_SHAPE_ELEMENTS:
            return Problem(
                "arg-value", pos,
                f"shape {_show(value)} of `{call.op}` has {size} elements, "
                f"more than the {MAX_SHAPE_ELEMENTS} (2**34) allowed",
                "check the dimensions: a tensor this large cannot fit in memory",
            )
    return None


# -- argument types ------------------------------------------------------------------------

# Keys an op passes on to a constructor whose type is known all the same: `vars.lr=abc`
# (or -1: torch's optimizers refuse a negative one) is refused by analyze at the
# argument, not by torch after init.
_PASSED_ON = {"optimizer": {"lr": "number>=0", "momentum": "number>=0", "weight_decay": "number>=0"}}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_CHECKS = {
    "int": _is_int,
    "float": _is_number,
    "number": _is_number,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "shape": lambda v: isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v),
    "sizes": lambda v: isinstance(v, list) and len(v) > 0 and all(_is_int(d) and d >= 1 for d in v),
    "duration": lambda v: isinstance(v, str) and DURATION.match(v) is not None,
    "null": lambda v: v is None,
    "any": lambda v: True,
    "loss": lambda v: isinstance(v, str) and (v in LOSS_NAMES or "." in v or ":" in v),
}
_NAMES = {
    "int": "an integer", "float": "a number", "number": "a number", "bool": "true or false",
    "str": "a string", "list": "a list", "dict": "a mapping", "duration": "a duration (500ms, 2s)",
    "shape": "a shape (a list of integers >= 0)", "null": "null", "any": "any value",
    "sizes": "a list of sizes (integers >= 1)",
    "loss": "cross_entropy, mse, model or a dotted path (pkg.mod:fn)",
}


def _type_ok(value: Any, t: Any) -> bool:
    if isinstance(t, tuple) and t and t[0] == "choice":
        return isinstance(value, str) and value in t[1:]
    if isinstance(t, tuple) and t and t[0] == "or":
        return any(_type_ok(value, option) for option in t[1:])
    if bound := bounded(t):
        base, op, least = bound
        return _CHECKS[base](value) and (value >= least if op == ">=" else value > least)
    # A type this version does not know is accepted: a newer spec must not break analyze.
    check = _CHECKS.get(t) if isinstance(t, str) else None
    return check is None or check(value)


def _describe(t: Any) -> str:
    if isinstance(t, tuple) and t and t[0] == "choice":
        return "one of " + ", ".join(repr(c) for c in t[1:])
    if isinstance(t, tuple) and t and t[0] == "or":
        return " or ".join(_describe(option) for option in t[1:])
    if bound := bounded(t):
        return f"{'an integer' if bound[0] == 'int' else 'a number'} {bound[1]} {bound[2]:g}"
    return _NAMES.get(t, str(t))


def _mentions_shape(t: Any) -> bool:
    return t == "shape" or (isinstance(t, tuple) and t[:1] == ("or",) and "shape" in t[1:])


def _show(value: Any) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _bounds_text(lo: int, hi: int | None, word: str) -> str:
    if hi is None:
        return f"at least {_count(lo, word)}"
    if lo == hi:
        return f"exactly {_count(lo, word)}"
    return f"{lo} to {hi} {word}s"


def _type_hint(key: str, value: Any, t: Any) -> str:
    choices = [c for option in (t[1:] if isinstance(t, tuple) and t[:1] == ("or",) else (t,))
               if isinstance(option, tuple) and option[:1] == ("choice",) for c in option[1:]]
    if isinstance(value, str) and (close := did_you_mean(value, choices)):
        return close  # optimizer `class: AdamWW`, a choice or null
    if isinstance(value, str) and t == "loss" and (close := did_you_mean(value, LOSS_NAMES)):
        return close
    return f"give `{key}` {_describe(t)}"


def _op_hint(spec: OpSpec) -> str:
    return f"write e.g. `{spec.example}`" if spec.example else f"see `jobrun ops {spec.name}`"
