"""`jobrun ops`: the op catalogue as text or JSON, from signatures alone (no torch)."""

from __future__ import annotations

import json
from typing import Any

from jobrun.errors import UsageError, did_you_mean
from jobrun.ops.registry import registry
from jobrun.ops.spec import OpSpec


def type_text(t: Any) -> str:
    if isinstance(t, tuple) and t and t[0] == "choice":
        return "|".join(t[1:])
    if isinstance(t, tuple) and t and t[0] == "or":
        return "|".join(type_text(x) for x in t[1:])
    return str(t)


def _bounds(names: tuple[str, ...], lo: int, hi: int | None) -> str:
    shown = ", ".join(names) if names else "-"
    if hi is None:
        shown += ", ..."
    if lo < len(names):
        shown += f" (at least {lo})"
    return shown


def spec_json(spec: OpSpec) -> dict[str, Any]:
    lo_in, hi_in = spec.input_bounds
    lo_out, hi_out = spec.output_bounds
    return {
        "name": spec.name,
        "category": spec.category,
        "doc": spec.doc,
        "inputs": list(spec.inputs), "min_inputs": lo_in, "max_inputs": hi_in,
        "outputs": list(spec.outputs), "min_outputs": lo_out, "max_outputs": hi_out,
        "args": [
            {"name": a.name, "type": type_text(a.type), "required": a.required,
             **({} if a.required else {"default": a.default}), "doc": a.doc}
            for a in spec.args
        ],
        "extra_args": spec.extra_args,
        "example": spec.example,
        # null: not declared, every input may change (see `jobrun.ops.spec.OpSpec`)
        "mutates": None if spec.mutates is None else list(spec.mutates),
        "keeps": None if spec.keeps is None else list(spec.keeps),
    }


def _changes_text(spec: OpSpec) -> str:
    if spec.name == "call" and spec.category == "core":  # jobrun.plans.state decides
        return "what `mutates` lists; none with pure: true; else its inputs that are not data"
    if spec.mutates is None:
        return "every input (not declared)"
    return ", ".join(spec.mutates) or "nothing"


def list_ops(as_json: bool = False) -> str:
    ops = registry()
    if as_json:
        return json.dumps([spec_json(s) for s in ops.values()], indent=2)
    width = max(len(n) for n in ops)
    lines: list[str] = []
    for category in ("core", "training", "user"):
        specs = [s for s in ops.values() if s.category == category]
        if not specs:
            continue
        lines.append(f"{category}:")
        lines += [f"  {s.name:<{width}}  {s.doc}" for s in specs]
    lines.append("")
    lines.append("`jobrun ops NAME` shows one op's inputs, outputs and arguments.")
    return "\n".join(lines)


def show_op(name: str, as_json: bool = False) -> str:
    ops = registry()
    spec = ops.get(name)
    if spec is None:
        hint = did_you_mean(name, ops) or "`jobrun ops` lists them all"
        raise UsageError(f"no op named {name!r}", hint=hint)
    if as_json:
        return json.dumps(spec_json(spec), indent=2)
    lines = [f"{spec.name}  ({spec.category})", f"  {spec.doc}", ""]
    lines.append(f"  in:   {_bounds(spec.inputs, *spec.input_bounds)}")
    lines.append(f"  out:  {_bounds(spec.outputs, *spec.output_bounds)}")
    lines.append(f"  changes in place: {_changes_text(spec)}")
    if spec.args:
        lines.append("  args:")
        for a in spec.args:
            default = "required" if a.required else f"default {json.dumps(a.default)}"
            doc = f"  {a.doc}" if a.doc else ""
            lines.append(f"    {a.name}: {type_text(a.type)} ({default}){doc}")
    if spec.extra_args:
        lines.append("    ...: other keys are passed through")
    if spec.example:
        lines += ["", "  example:", f"    {spec.example}"]
    return "\n".join(lines)
