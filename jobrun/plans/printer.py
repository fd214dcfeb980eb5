"""Plan IR -> readable pseudo-code (`jobrun print`) or JSON data (colour: plans/colour.py).

    text = render_text(plan)                     # the whole job, one op per line
    text = render_text(plan, factor_prefixes=True)   # enc/[w, b] for enc/w, enc/b
    data = render_json(plan)                     # the same structure as JSON-able data

The text is built as a list of lines joined once, so a plan of 100,000 ops renders in a
fraction of a second. Nothing here depends on dict order other than the plan's own source
order, on object addresses or on the clock: the same plan always gives the same text.
Neither torch nor rich is imported here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from jobrun.plans import ir, precision
from jobrun.plans.load import to_plain
from jobrun.plans.visit import Visitor

INDENT = "    "
MAX_LITERAL = 64  # longer strings and lists are cut, with a ...<+len=N> mark
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PLAIN_MAP_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


def render_text(plan: ir.Plan, factor_prefixes: bool = False) -> str:
    """The whole job as pseudo-code: a header, then each non-empty group and its tasks.

    Ends with a newline. `factor_prefixes` groups blob names of one scope in name lists.
    """
    printer = _TextPrinter(factor_prefixes)
    printer.visit(plan)
    return printer.out.text()


def render_json(plan: ir.Plan) -> dict[str, Any]:
    """The job as plain JSON-able data: header fields, the four groups, tasks and steps.

    Every group is present (possibly with no tasks) so that consumers see one shape.
    Argument values are given in full (never cut).
    """
    return _JsonBuilder().visit(plan)


# -- values ----------------------------------------------------------------------------


def format_value(value: Any) -> str:
    """A value as a compact flow literal: strings quoted, lists and mappings inline.

    Strings are always quoted so that they never read as blob names.
    """
    # A dispatch on the exact type first: this runs for every argument of every op.
    fmt = _FORMATTERS.get(type(value))
    if fmt is None:  # a subclass (the loader's PMap and PList) or something unexpected
        fmt = next((f for kind, f in _FORMATTERS.items() if isinstance(value, kind)), _as_string)
    return fmt(value)


def _format_seq(value: Sequence[Any]) -> str:
    return "[" + ", ".join([format_value(v) for v in value]) + "]"


def _format_map(value: dict[Any, Any]) -> str:
    return "{" + ", ".join([f"{_map_key(k)}: {format_value(v)}" for k, v in value.items()]) + "}"


def format_arg(value: Any) -> str:
    """format_value, a string or list cut after MAX_LITERAL characters with a mark giving
    the full length. A mapping, and a list that holds one, is not cut: each of its values
    is shown as an argument is, so that no nested argument is hidden (an EMA's `decay`
    in `build`'s mapping, a layer in a list of layers)."""
    if isinstance(value, dict):
        return "{" + ", ".join([f"{_map_key(k)}: {format_arg(v)}" for k, v in value.items()]) + "}"
    if isinstance(value, list | tuple) and any(isinstance(v, dict) for v in value):
        return "[" + ", ".join([format_arg(v) for v in value]) + "]"
    text = format_value(value)
    if len(text) > MAX_LITERAL and isinstance(value, str | list | tuple):
        return f"{text[:MAX_LITERAL]}...<+len={len(text)}>"
    return text


def _quote(s: str) -> str:
    if s.isprintable() and '"' not in s and "\\" not in s:
        return f'"{s}"'
    # Escaping every non-printable character (newlines, U+2028, ...) keeps one op per line.
    return json.dumps(s, ensure_ascii=not s.isprintable())


def _format_float(v: float) -> str:
    # `inf` would read as a blob name: infinities are written as in the plan.
    return repr(v) if math.isfinite(v) else ("-.inf" if v < 0 else ".inf")


_FORMATTERS: dict[type, Callable[[Any], str]] = {
    str: _quote,
    bool: lambda v: "true" if v else "false",
    int: str,
    float: _format_float,
    type(None): lambda v: "null",
    list: _format_seq,
    tuple: _format_seq,
    dict: _format_map,
}


def _as_string(value: Any) -> str:
    return _quote(str(value))  # plans hold plain data; this never shows an object address


def _map_key(key: Any) -> str:
    return key if isinstance(key, str) and _PLAIN_MAP_KEY.match(key) else format_value(key)


@lru_cache(maxsize=4096)  # argument names repeat on almost every op
def _arg_key(key: str) -> str:
    return key if _PLAIN_KEY.match(key) else _quote(key)


# -- names -----------------------------------------------------------------------------


def factor_names(names: Sequence[str]) -> list[str]:
    """Group neighbouring names that share their first scope: enc/w, enc/b -> enc/[w, b].

    Scopes nest (enc/[w, l1/[w, b]]) and the order of the names is kept, so only
    neighbours are grouped; a group of one is written as the plain name.
    """
    n = len(names)
    if n < 2:
        return list(names)
    out: list[str] = []
    i = 0
    while i < n:
        name = names[i]
        cut = name.find("/") + 1
        j = i + 1
        if cut:
            prefix = name[:cut]
            while j < n and names[j].startswith(prefix):
                j += 1
        if j - i == 1:
            out.append(name)
            i = j
            continue
        rest = [other[cut:] for other in names[i:j]]
        if "/" in "".join(rest):  # deeper scopes: factor them too (rarely needed, so checked)
            rest = factor_names(rest)
        out.append(name[:cut] + (rest[0] if len(rest) == 1 else "[" + ", ".join(rest) + "]"))
        i = j
    return out


# -- text ------------------------------------------------------------------------------


class _Lines:
    """Indented lines; `block(header)` indents what is added inside it."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._depth = 0
        self._pad = ""

    def add(self, text: str) -> None:
        self.lines.append(self._pad + text)

    def blank(self) -> None:
        if self.lines and self.lines[-1]:
            self.lines.append("")

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        self.add(header)
        start = len(self.lines)
        self._indent(1)
        try:
            yield
        finally:
            if len(self.lines) == start:
                self.add("pass")  # an empty block still shows that it is empty
            self._indent(-1)

    def _indent(self, step: int) -> None:
        self._depth += step
        self._pad = INDENT * self._depth

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class _TextPrinter(Visitor):
    def __init__(self, factor_prefixes: bool) -> None:
        self.out = _Lines()
        self.factor = factor_prefixes
        self._epoch_header = "epoch:"

    def names(self, refs: Sequence[ir.BlobRef | str]) -> str:
        names = [r if isinstance(r, str) else r.name for r in refs]
        return ", ".join(factor_names(names) if self.factor else names)

    def inputs(self, ins: Sequence[ir.Input]) -> list[str]:
        if not self.factor:
            return [i.name if type(i) is ir.BlobRef else format_value(i.value) for i in ins]
        # Literals split the runs of names that may be factored; their places stay.
        out: list[str] = []
        run: list[str] = []
        for item in ins:
            if type(item) is ir.BlobRef:
                run.append(item.name)
                continue
            if run:
                out += factor_names(run)
                run = []
            out.append(format_value(item.value))
        return out + factor_names(run) if run else out

    # -- job, groups, tasks --------------------------------------------------------------
    def visit_Plan(self, plan: ir.Plan) -> None:
        self._header(plan)
        self._epoch_header = f"epoch ({_stop_text(plan)}):"
        for group in plan.groups:
            if group.tasks:
                self.out.blank()
                self.visit(group)

    def _header(self, plan: ir.Plan) -> None:
        add = self.out.add
        add(f"job: {plan.job}")
        add(f"seed: {plan.seed}")
        add(f"device: {plan.device}")
        add(f"replicas: {plan.replicas}")
        if plan.parallel != "ddp":
            add(f"parallel: {plan.parallel}")
        if plan.fsdp_layers:
            add(f"fsdp_layers: [{', '.join(plan.fsdp_layers)}]")
        if plan.parallel == "fsdp":
            amp = precision.fsdp_amp(plan)
            add(f"fsdp precision: parameters gathered in {amp} (train.step amp), gradients "
                "reduced in float32" if amp else "fsdp precision: float32")
        if plan.max_restarts:
            add(f"max_restarts: {plan.max_restarts}")
        if plan.vars:
            add("vars: {" + ", ".join(f"{_map_key(k)}: {format_arg(v)}" for k, v in to_plain(plan.vars).items()) + "}")
        add(f"max_epochs: {format_value(plan.max_epochs)}")
        if plan.max_steps is not None:
            add(f"max_steps: {plan.max_steps}")
        add(f"stop_when: [{self.names(plan.stop_when)}]")
        if plan.early_stop is not None:
            add(f"early_stop: {format_value(_early_stop_data(plan.early_stop))}")
        add(f"checkpoint: {_checkpoint_text(plan.checkpoint)}")
        if plan.loggers:
            add(f"loggers: [{', '.join(plan.loggers)}]")
        if plan.checkpoint is not None:
            for node, names in _checkpointed(plan).items():
                add(f"checkpointed @ {node}: [{self.names(names)}] + random state")

    def visit_Group(self, group: ir.Group) -> None:
        header = self._epoch_header if group.name == "epoch" else f"{group.name}:"
        with self.out.block(header):
            for i, task in enumerate(group.tasks):
                if i:
                    self.out.blank()
                self.visit(task)

    def visit_Task(self, task: ir.Task) -> None:
        traits = task.workspace + (f", instances={task.instances}" if task.instances != 1 else "")
        outputs = f" -> outputs [{self.names(task.outputs)}]" if task.outputs else ""
        with self.out.block(f"task {task.name} @ {task.node} [{traits}]{outputs}:"):
            if not (task.init or task.exit):
                self.visit_block(task.do)
                return
            # With init or exit present, every section is labelled so none reads as another.
            for label, steps in (("init", task.init), ("do", task.do), ("exit", task.exit)):
                if steps or label == "do":
                    with self.out.block(f"{label}:"):
                        self.visit_block(steps)

    # -- steps ---------------------------------------------------------------------------
    def visit_OpCall(self, op: ir.OpCall) -> None:
        parts = self.inputs(op.ins)
        parts += [f"{_arg_key(k)}={format_arg(v)}" for k, v in op.args]
        call = f"{op.op}({', '.join(parts)})"
        self.out.add((f"{self.names(op.outs)} = {call}" if op.outs else call) + _note(op))

    def visit_Loop(self, loop: ir.Loop) -> None:
        if loop.count is None:
            head = "loop until stop"
        elif isinstance(loop.count, ir.BlobRef):
            head = f"loop {loop.count.name}"
        else:
            head = f"loop {loop.count}"
        if loop.index is not None:
            head += f" as {loop.index.name}"
        with self.out.block(head + ":" + _note(loop)):
            self.visit_block(loop.body)

    def visit_StopIf(self, step: ir.StopIf) -> None:
        self.out.add(f"stop_if {step.cond.name}" + _note(step))

    def visit_If(self, step: ir.If) -> None:
        for i, branch in enumerate(step.branches):
            with self.out.block(f"{'elif' if i else 'if'} {branch.cond.name}:" + ("" if i else _note(step))):
                self.visit_block(branch.body)
        if step.orelse is not None:
            with self.out.block("else:"):
                self.visit_block(step.orelse)

    def visit_Parallel(self, step: ir.Parallel) -> None:
        with self.out.block("parallel:" + _note(step)):
            for branch in step.branches:
                with self.out.block(f"branch {branch.name}:" if branch.name else "branch:"):
                    self.visit_block(branch.body)

    def visit_Report(self, step: ir.Report) -> None:
        # A period may be written "500 ms"; collapsing its spaces keeps it on one line.
        with self.out.block(f"report every {' '.join(step.period_text.split())}:" + _note(step)):
            self.visit_block(step.body)


def _note(step: ir.Step) -> str:
    """What a step carries besides its kind: `every N steps`, its id."""
    notes = [f"every {step.every} steps"] * (step.every is not None) + [f"id: {step.id}"] * (step.id is not None)
    return "  # " + "; ".join(notes) if notes else ""


def _stop_text(plan: ir.Plan) -> str:
    conds = [ref.name for ref in plan.stop_when]
    early = plan.early_stop
    if early is not None:
        name = early.monitor.name.name
        better = f"{name} better by more than {format_value(early.min_delta)}" if early.min_delta else f"better {name}"
        epochs = max(early.patience, 1)  # patience 0 stops at the first epoch without one too
        conds.append(f"no {better} for {epochs} epoch{'s' * (epochs != 1)}")
    if plan.max_epochs is not None:
        conds.append(f"epoch {plan.max_epochs}")
    if plan.max_steps is not None:
        conds.append(f"step {plan.max_steps}")
    return "repeat until " + " or ".join(conds) if conds else "repeat forever: no stop condition"


def _checkpoint_text(ckpt: ir.Checkpoint | None) -> str:
    if ckpt is None:
        return "off"
    fields: dict[str, Any] = {"dir": ckpt.dir, "every": ckpt.every, "keep": ckpt.keep, "upload": ckpt.upload}
    if ckpt.background:
        fields["async"] = True
    if ckpt.best is not None:
        fields["best"] = _best_data(ckpt.best)
    for key in ("include", "exclude"):
        if getattr(ckpt, key):
            fields[key] = [ref.name for ref in getattr(ckpt, key)]
    return format_value(fields)


def _early_stop_data(early: ir.EarlyStop) -> dict[str, Any]:
    return {"monitor": early.monitor.name.name, "mode": early.monitor.mode, "patience": early.patience,
            "min_delta": early.min_delta}


def _best_data(best: ir.Best) -> dict[str, Any]:
    return {"monitor": best.monitor.name.name, "mode": best.monitor.mode, "keep": best.keep}


def _checkpointed(plan: ir.Plan) -> dict[str, tuple[str, ...]]:
    """The blobs each node's checkpoints hold (worked out from the ops' signatures)."""
    from jobrun.plans.state import checkpointed

    return checkpointed(plan)


# -- json ------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    """A plan value as JSON data: JSON has no infinity, so it is written as the plan
    writes it, the string ".inf" or "-.inf" (never a blob name: those start with a letter)."""
    if isinstance(value, float) and not math.isfinite(value):
        return _format_float(value)
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return value


class _JsonBuilder(Visitor):
    """Each visit_* returns the JSON-able data of its node."""

    def steps(self, block: Sequence[ir.Step]) -> list[dict[str, Any]]:
        return [self.visit(step) for step in block]

    def visit_Plan(self, plan: ir.Plan) -> dict[str, Any]:
        ckpt = plan.checkpoint
        return {
            "job": plan.job,
            "source": plan.source,
            "seed": plan.seed,
            "device": plan.device,
            "replicas": plan.replicas,
            "parallel": plan.parallel,
            "fsdp_layers": list(plan.fsdp_layers),
            "fsdp_amp": precision.fsdp_amp(plan),
            "max_restarts": plan.max_restarts,
            "vars": _json_value(plan.vars),
            "max_epochs": plan.max_epochs,
            "max_steps": plan.max_steps,
            "stop_when": [r.name for r in plan.stop_when],
            "early_stop": None if plan.early_stop is None else _json_value(_early_stop_data(plan.early_stop)),
            "checkpoint": None if ckpt is None else {
                "dir": ckpt.dir, "every": ckpt.every, "keep": ckpt.keep, "upload": ckpt.upload,
                "async": ckpt.background, "best": None if ckpt.best is None else _best_data(ckpt.best),
                "include": [r.name for r in ckpt.include], "exclude": [r.name for r in ckpt.exclude],
                "blobs": {node: list(names) for node, names in _checkpointed(plan).items()},
            },
            "loggers": list(plan.loggers),
            "groups": [self.visit(g) for g in plan.groups],
        }

    def visit_Group(self, group: ir.Group) -> dict[str, Any]:
        return {"name": group.name, "tasks": [self.visit(t) for t in group.tasks]}

    def visit_Task(self, task: ir.Task) -> dict[str, Any]:
        return {
            "name": task.name,
            "node": task.node,
            "workspace": task.workspace,
            "instances": task.instances,
            "outputs": [r.name for r in task.outputs],
            "line": task.pos.line,
            "init": self.steps(task.init),
            "do": self.steps(task.do),
            "exit": self.steps(task.exit),
        }

    def visit_OpCall(self, op: ir.OpCall) -> dict[str, Any]:
        return {
            "kind": "op",
            "op": op.op,
            # Literals are numbers or booleans, blob names strings: the JSON type tells them apart.
            "in": [i.name if isinstance(i, ir.BlobRef) else _json_value(i.value) for i in op.ins],
            "out": [r.name for r in op.outs],
            "args": {k: _json_value(v) for k, v in op.args},
            "id": op.id,
            "every_steps": op.every,
            "line": op.pos.line,
        }

    def visit_Loop(self, loop: ir.Loop) -> dict[str, Any]:
        count = loop.count.name if isinstance(loop.count, ir.BlobRef) else loop.count
        return {
            "kind": "loop",
            "count": count,
            "as": loop.index.name if loop.index is not None else None,
            "do": self.steps(loop.body),
            "id": loop.id,
            "every_steps": loop.every,
            "line": loop.pos.line,
        }

    def visit_StopIf(self, step: ir.StopIf) -> dict[str, Any]:
        return {"kind": "stop_if", "cond": step.cond.name, "id": step.id, "every_steps": step.every, "line": step.pos.line}

    def visit_If(self, step: ir.If) -> dict[str, Any]:
        branches = [
            {"cond": b.cond.name, "then": self.steps(b.body), "line": b.pos.line}
            for b in step.branches
        ]
        orelse = self.steps(step.orelse) if step.orelse is not None else None
        return {"kind": "if", "branches": branches, "else": orelse, "id": step.id, "every_steps": step.every, "line": step.pos.line}

    def visit_Parallel(self, step: ir.Parallel) -> dict[str, Any]:
        branches = [
            {"name": b.name, "do": self.steps(b.body), "line": b.pos.line} for b in step.branches
        ]
        return {"kind": "parallel", "branches": branches, "id": step.id, "every_steps": step.every, "line": step.pos.line}

    def visit_Report(self, step: ir.Report) -> dict[str, Any]:
        return {
            "kind": "report",
            "every": step.period_text,
            "seconds": step.period,
            "do": self.steps(step.body),
            "id": step.id,
            "every_steps": step.every,
            "line": step.pos.line,
        }
