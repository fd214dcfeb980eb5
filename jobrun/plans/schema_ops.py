"""The JSON Schema of op steps, derived from each op's signature (its OpSpec).

:mod:`jobrun.plans.schema` builds the plan's schema around these: one definition per op
(``op_schema``), the op call that picks one by its key (``op_call``), and the references
and the step id that both parts share.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jobrun.ops.spec import LOSS_NAMES, REQUIRED, ArgSpec, ArgType, OpSpec, bounded
from jobrun.plans import keys as plan_keys

VAR = {"$ref": "#/$defs/var"}
BLOB = {"$ref": "#/$defs/blob"}


def anchored(rx: re.Pattern[str]) -> str:
    """A compiler regex (used with .match and ending in \\Z) as an ECMA-262 pattern."""
    body = rx.pattern.removesuffix(r"\Z")
    return f"^{body}$"


STEP_ID = {
    "description": (
        "A name for this step, unique in its task, that overrides can address "
        "(`epoch.TASK.ID.ARG=VALUE`): letters, digits, '_' and '-', no dots."
    ),
    "type": "string",
    "pattern": anchored(plan_keys.STEP_ID),
    "not": {"enum": list(plan_keys.TASK_KEYS)},
}


def op_def(name: str) -> str:
    return f"op:{name}"


# `every: N` of any step: it runs at global steps 0, N, 2N, ... only.
EVERY = {
    "description": "Run this step only at global steps 0, N, 2N, ... (optimizer steps taken; "
    "inside a loop, as the loop's iteration began), once per step.",
    "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}, VAR],
}


def op_call(ops: dict[str, OpSpec]) -> dict[str, Any]:
    return {
        "description": "An op call: one key, the op's name, holding its arguments (and an `id`).",
        "type": "object",
        "minProperties": 1,
        "properties": {**{name: {"$ref": f"#/$defs/{op_def(name)}"} for name in ops}, "id": STEP_ID},
        "additionalProperties": False,  # an unknown op
        # the op's name and, maybe, an id beside it
        "if": {"required": ["id"]},
        "then": {"minProperties": 2, "maxProperties": 2},
        "else": {"maxProperties": 1},
    }


def op_schema(spec: OpSpec) -> dict[str, Any]:
    """The schema of one op's mapping: `in`, `out` and its typed arguments."""
    in_lo, in_hi = spec.input_bounds
    out_lo, out_hi = spec.output_bounds
    properties = {
        "in": _slots("in", spec.inputs, in_lo, in_hi, {"$ref": "#/$defs/input"}),
        "out": _slots("out", spec.outputs, out_lo, out_hi, BLOB),
        "every": EVERY,
        **{a.name: arg_schema(a) for a in spec.args},
    }
    required = [k for k, lo in (("in", in_lo), ("out", out_lo)) if lo > 0]
    required += [a.name for a in spec.args if a.required]
    schema: dict[str, Any] = {
        "title": spec.name,
        "description": spec.doc + (f"\nExample: {spec.example}" if spec.example else ""),
        # `- copy:` with nothing after it is an empty call, unless something is required.
        "type": "object" if required else ["object", "null"],
        "properties": properties,
        "additionalProperties": spec.extra_args,
    }
    if required:
        schema["required"] = required
    return schema


def _slots(
    key: str, names: tuple[str, ...], lo: int, hi: int | None, item: dict[str, Any]
) -> dict[str, Any]:
    """`in`/`out`: one item or a list of them, as many as the op takes (null: none)."""
    if hi == 0:
        return {"description": f"This op takes no `{key}`.", "type": ["array", "null"], "maxItems": 0}
    many: dict[str, Any] = {"type": "array", "items": item, "minItems": lo}
    if hi is not None:
        many["maxItems"] = hi
    shown = ", ".join(names) + (", ..." if hi is None else "")
    count = f"{lo}" if lo == hi else f"{lo} or more" if hi is None else f"{lo} to {hi}"
    alternatives = [many]
    if lo <= 1 and (hi is None or hi >= 1):
        alternatives.append(item)
    if lo == 0:
        alternatives.append({"type": "null"})
    return {"description": f"{count}: {shown}", "anyOf": alternatives}


def arg_schema(a: ArgSpec) -> dict[str, Any]:
    """One argument's schema from its ArgSpec type, with its doc and default."""
    schema = type_schema(a.type)
    note = f"{type_text(a.type)}" + ("; required" if a.required else f"; default {_json(a.default)}")
    schema["description"] = f"{a.doc} ({note})" if a.doc else note
    if not a.required and _is_json(a.default):
        schema["default"] = json.loads(json.dumps(a.default))  # tuples become lists
    return schema


def type_schema(t: ArgType) -> dict[str, Any]:
    """An ArgSpec type (see jobrun.ops.spec) as a schema that also accepts "${var}"."""
    alternatives = _alternatives(t)
    if any(not alt for alt in alternatives):
        return {}  # "any" among them
    if not any(alt.get("type") == "string" and "pattern" not in alt for alt in alternatives):
        alternatives.append(VAR)  # a plain string already accepts "${var}"
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


_SIMPLE: dict[str, dict[str, Any]] = {
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "number": {"type": "number"},
    "bool": {"type": "boolean"},
    "str": {"type": "string"},
    "list": {"type": "array"},
    "dict": {"type": "object"},
    "shape": {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0}, VAR]}},
    "sizes": {"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "integer", "minimum": 1}, VAR]}},
    "any": {},
    "null": {"type": "null"},
    "duration": {"$ref": "#/$defs/duration"},
    "loss": {"anyOf": [{"enum": list(LOSS_NAMES)}, {"type": "string", "pattern": r"[.:]"}]},
}


def _alternatives(t: ArgType) -> list[dict[str, Any]]:
    if isinstance(t, tuple) and t and t[0] == "or":
        return [alt for sub in t[1:] for alt in _alternatives(sub)]
    if isinstance(t, tuple) and t and t[0] == "choice":
        return [{"enum": list(t[1:])}]
    if isinstance(t, str) and t in _SIMPLE:
        return [dict(_SIMPLE[t])]
    if bound := bounded(t):
        base, op, least = bound
        return [{"type": "integer" if base == "int" else "number",
                 "minimum" if op == ">=" else "exclusiveMinimum": int(least) if least.is_integer() else least}]
    return [{}]  # a type this module does not know (a plug-in's): accept anything


def type_text(t: ArgType) -> str:
    """An ArgSpec type in words: `int`, `relu|gelu|tanh`, `number or null`."""
    if isinstance(t, tuple) and t and t[0] == "or":
        return " or ".join(type_text(sub) for sub in t[1:])
    if isinstance(t, tuple) and t and t[0] == "choice":
        return "|".join(str(c) for c in t[1:])
    return str(t)


def _is_json(value: Any) -> bool:
    if value is REQUIRED:
        return False
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _json(value: Any) -> str:
    return json.dumps(value) if _is_json(value) else repr(value)
