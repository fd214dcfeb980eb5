"""Before compiling: `${var}` substitution (after the overrides of
:mod:`jobrun.plans.overrides`).

It works on the positioned data of :mod:`jobrun.plans.load`, so a value that came from a
variable still points at a place the user can find; where an override gave the var
(`vars.batch=0`), that place is a :class:`SetPos` that says so.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jobrun.errors import PlanError, Pos, SetPos, did_you_mean
from jobrun.plans import arith
from jobrun.plans.load import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    CloneBudgetExceeded,
    PList,
    PMap,
    clone,
    nesting,
    to_plain,
)
from jobrun.plans.scalars import kind_of, shorten, show

VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_REF = re.compile(r"\$(\$?)\{([^}]*)\}")
BUILTINS = ("plan_dir", "run_dir")
# A string may not grow past this by substitution: vars that repeat vars that repeat
# vars would otherwise fill the memory ("billion laughs" without aliases).
MAX_TEXT = 1_000_000


def substitute(tree: PMap, builtins: dict[str, str]) -> PMap:
    """Replace `${name}` in every string value by the var's value (`$${` escapes it).

    A string that is exactly `${name}` takes the var's value with its type. Vars may use
    the built-ins and vars defined above them. Works in place and returns `tree`.
    """
    env: dict[str, Any] = dict(builtins)
    sets: dict[str, list[str]] = {}
    budget = [MAX_ALIAS_NODES]
    raw_vars = tree.get("vars")
    if raw_vars is not None:
        if not isinstance(raw_vars, dict):
            raise PlanError(
                f"`vars` must be a mapping of names to values, not {kind_of(raw_vars)}",
                _at(tree, "vars"),
                "write vars: {lr: 0.1}",
            )
        later = list(raw_vars)
        for name, value in raw_vars.items():
            later.remove(name)
            kpos = raw_vars.key_at(name) if isinstance(raw_vars, PMap) else _at(tree, "vars")
            if not VAR_NAME.match(name):
                raise PlanError(
                    f"bad var name {show(name)}", kpos,
                    "a var name is letters, digits and _, not starting with a digit",
                )
            if name in BUILTINS:
                raise PlanError(
                    f"var {name!r} is built in and cannot be redefined", kpos, "rename your var"
                )
            ctx = _Ctx(env, budget, later, name, sets)
            resolved = _subst(value, ctx, _at(raw_vars, name), 3)
            raw_vars[name] = env[name] = resolved
            given = _set_by(_at(raw_vars, name))
            if given or (ctx.used and value.__class__ is str):  # `b: ${a}` passes vars.a=0 on
                sets[name] = [given] if given else ctx.used
    ctx = _Ctx(env, budget, [], None, sets)
    for key, value in tree.items():
        if key != "vars":  # each top-level value is at depth 2 (the plan itself is 1)
            tree[key] = _subst(value, ctx, _at(tree, key), 2)
            _mark(tree, key, ctx)
    return tree


def _set_by(pos: Pos) -> str | None:
    """The override (`vars.batch=0`) that gave the value at `pos`, if one did."""
    return pos.file.removeprefix("--set ") if pos.line == 0 and pos.file.startswith("--set ") else None


def _mark(container: Any, key: Any, ctx: _Ctx) -> None:
    """The value at `key` was just substituted: where overrides gave its vars, its
    position says so."""
    if ctx.used and isinstance(container, PMap | PList):
        pos = SetPos(container.at(key), ctx.used)
        if isinstance(container, PMap):
            container.val_pos[key] = pos
        elif key < len(container.item_pos):
            container.item_pos[key] = pos
    ctx.used = []


class _Ctx:
    """What a substitution may use: the vars so far, the clone budget, for hints."""

    __slots__ = ("env", "budget", "later", "defining", "sets", "used")

    def __init__(self, env: dict[str, Any], budget: list[int], later: list[str], defining: str | None,
                 sets: dict[str, list[str]]):
        self.env = env
        self.budget = budget
        self.later = later  # vars defined below the one being defined
        self.defining = defining
        self.sets = sets  # var name: the overrides that gave its value
        self.used: list[str] = []  # the overrides the last substituted string used


def _at(container: Any, key: Any) -> Pos:
    if isinstance(container, PMap | PList):
        return container.at(key)
    return Pos("<plan>")


def _subst(value: Any, ctx: _Ctx, pos: Pos, depth: int) -> Any:
    """`value` (written at `pos`) with its references replaced; containers are updated in
    place.

    `depth` counts the containers around `value` (the plan itself is 1). Strings are
    looked at in the loops rather than by a call each: most values of a plan are strings.
    """
    if value.__class__ is str:
        return _subst_str(value, ctx, pos, depth) if "${" in value else value
    if isinstance(value, dict):
        for k, v in value.items():
            if v.__class__ is str:
                if "${" in v:
                    value[k] = _subst_str(v, ctx, _at(value, k), depth + 1)
                    _mark(value, k, ctx)
            elif isinstance(v, list | dict):
                _subst(v, ctx, _at(value, k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if v.__class__ is str:
                if "${" in v:
                    value[i] = _subst_str(v, ctx, _at(value, i), depth + 1)
                    _mark(value, i, ctx)
            elif isinstance(v, list | dict):
                _subst(v, ctx, _at(value, i), depth + 1)
    return value


def _subst_str(text: str, ctx: _Ctx, pos: Pos, depth: int) -> Any:
    """`text` with its references replaced; `depth` is where the result will sit."""
    whole = _REF.fullmatch(text)
    if whole and not whole.group(1):
        value = _value(whole.group(2), ctx, pos)
        if not isinstance(value, list | dict):
            return value
        if depth - 1 + nesting(value, MAX_DEPTH - depth + 1) > MAX_DEPTH:
            raise PlanError(
                f"${{{whole.group(2).strip()}}} nests values more than {MAX_DEPTH} levels deep here",
                pos, "flatten the var, or use it less deep in the plan",
            )
        try:
            return clone(value, ctx.budget)
        except CloneBudgetExceeded:
            raise PlanError(
                f"vars expand to more than {MAX_ALIAS_NODES} values",
                pos,
                "do not nest list or mapping vars inside each other so many times",
            ) from None

    def repl(m: re.Match[str]) -> str:
        if m.group(1):  # "$${x}" -> "${x}"
            return "${" + m.group(2) + "}"
        return _as_text(_value(m.group(2), ctx, pos))

    out = _REF.sub(repl, text)
    if len(out) > MAX_TEXT:
        raise PlanError(
            f"a string grows to {len(out)} characters by substituting vars (at most {MAX_TEXT})",
            pos,
            "do not repeat vars inside vars so many times",
        )
    return out


def _value(text: str, ctx: _Ctx, pos: Pos) -> Any:
    """The value of `${text}`: a var's, or arithmetic on vars and numbers."""
    name = text.strip()
    if VAR_NAME.match(name) or not name:
        return _lookup(name, ctx, pos)
    try:
        return arith.evaluate(name, lambda n: _lookup(n, ctx, pos))
    except arith.ArithError as e:
        raise PlanError(str(e), pos, e.hint) from None


def _lookup(name: str, ctx: _Ctx, pos: Pos) -> Any:
    name = name.strip()
    if name in ctx.env:
        for given in ctx.sets.get(name, ()):
            if given not in ctx.used:
                ctx.used.append(given)
        return ctx.env[name]
    if name == ctx.defining:
        hint = f"a var cannot use itself; give {name!r} a value"
    elif name in ctx.later:
        hint = f"{name!r} is defined below; a var may only use the vars defined above it"
    else:
        known = sorted(ctx.env)
        shown = ", ".join(known[:12]) + (f" and {len(known) - 12} more" if len(known) > 12 else "")
        hint = did_you_mean(name, ctx.env) or f"define it under `vars:` (known: {shown})"
    raise PlanError(f"undefined variable ${{{shorten(name)}}}", pos, hint)


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | dict):
        return json.dumps(to_plain(value))
    return str(value)
