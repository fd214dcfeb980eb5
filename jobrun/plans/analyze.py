"""Static checks of a compiled plan: a list of diagnostics, never an exception, never torch.

`analyze(plan)` walks the job in the order the runner executes it::

    for group in init, epoch, download, exit:
        for task in group:              # concurrent: each starts from the group's global state
            walk init, do, exit         # check op calls, read and define blobs
        merge what global-workspace tasks created into their node's global workspace
    resolve the reads that found nothing (same-group writers, later epochs), stop conditions

Definedness is tracked per node as ``name -> DEF | MAYBE`` in one dict with an undo log
(:class:`_Flow`). A scope (an `if` arm, a parallel branch, a private workspace) is a mark
in that log: leaving it undoes its entries and hands back what it changed; a scope that
may not run to its end (a loop that may run 0 times, code after a stop_if) lowers its own
entries to MAYBE in place. A step costs O(1) and no workspace is ever copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jobrun.errors import Pos, did_you_mean
from jobrun.ops.spec import OpSpec
from jobrun.plans import ir
from jobrun.plans.compile import DURATION
from jobrun.plans.visit import Visitor

MAYBE, DEF = 1, 2  # ordered: a later definition can only make a blob more defined
MAX_SHAPE_ELEMENTS = 2**34
_MAX_SUGGESTIONS = 50  # difflib is slow on huge name sets: bound the cost of hints


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning"
    pos: Pos
    message: str
    code: str
    hint: str | None = None

    def format(self) -> str:
        text = f"{self.pos}: {self.severity}: {self.message}"
        return text + f"\n  hint: {self.hint}" if self.hint else text

    def to_json(self) -> dict[str, Any]:
        return {
            "severity": self.severity, "code": self.code, "message": self.message,
            "hint": self.hint, "file": self.pos.file, "line": self.pos.line, "col": self.pos.col,
        }


def analyze(plan: ir.Plan, ops: Mapping[str, OpSpec] | None = None) -> list[Diagnostic]:
    """Every problem found in `plan`, sorted by position; `ops` defaults to the registry."""
    if ops is None:
        from jobrun.ops.registry import registry

        ops = registry()
    analyzer = _Analyzer(ops)
    analyzer.visit(plan)
    # Severity, code and message break ties so that the order never depends on the walk.
    return sorted(
        analyzer.diags,
        key=lambda d: (d.pos.file, d.pos.line, d.pos.col, d.severity != "error", d.code, d.message),
    )


# -- argument types ------------------------------------------------------------------------


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
    "duration": lambda v: isinstance(v, str) and DURATION.match(v) is not None,
    "null": lambda v: v is None,
    "any": lambda v: True,
}
_NAMES = {
    "int": "an integer", "float": "a number", "number": "a number", "bool": "true or false",
    "str": "a string", "list": "a list", "dict": "a mapping", "duration": "a duration (500ms, 2s)",
    "shape": "a shape (a list of integers >= 0)", "null": "null", "any": "any value",
}


def _type_ok(value: Any, t: Any) -> bool:
    if isinstance(t, tuple) and t and t[0] == "choice":
        return isinstance(value, str) and value in t[1:]
    if isinstance(t, tuple) and t and t[0] == "or":
        return any(_type_ok(value, option) for option in t[1:])
    # A type this version does not know is accepted: a newer spec must not break analyze.
    check = _CHECKS.get(t) if isinstance(t, str) else None
    return check is None or check(value)


def _describe(t: Any) -> str:
    if isinstance(t, tuple) and t and t[0] == "choice":
        return "one of " + ", ".join(repr(c) for c in t[1:])
    if isinstance(t, tuple) and t and t[0] == "or":
        return " or ".join(_describe(option) for option in t[1:])
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
    if isinstance(value, str) and isinstance(t, tuple) and t[:1] == ("choice",):
        close = did_you_mean(value, t[1:])
        if close:
            return close
    return f"give `{key}` {_describe(t)}"


def _op_hint(spec: OpSpec) -> str:
    return f"write e.g. `{spec.example}`" if spec.example else f"see `jobrun ops {spec.name}`"


# -- workspace flow ------------------------------------------------------------------------

_Changes = dict[str, tuple[int, Pos, bool]]  # name -> (status, first definition, newly created)


class Why:
    """Why a blob is only MAYBE defined, with the line it names worked out only when a
    diagnostic says it: positions cost a second parse of the file the first time."""

    __slots__ = ("text", "pos")

    def __init__(self, text: str, pos: Pos):
        self.text = text  # with a {line} field
        self.pos = pos

    def __str__(self) -> str:
        return self.text.format(line=self.pos.line)


class _Flow:
    """The blobs one node's tasks can see: a dict plus an undo log of its changes.

    Statuses only grow (absent -> MAYBE -> DEF) through `define`; a scope that turns out
    to be conditional lowers its own entries in place with `weaken`.
    """

    def __init__(self) -> None:
        self.state: dict[str, int] = {}
        self.why: dict[str, Why] = {}  # why a blob is only MAYBE defined
        # The log is parallel lists, not a list of tuples: a tuple per definition would make
        # the garbage collector rescan the whole plan every few thousand steps.
        self.names: list[str] = []
        self.olds: list[int | None] = []
        self.where: list[Pos] = []

    def mark(self) -> int:
        return len(self.names)

    def define(self, name: str, status: int, pos: Pos, why: Why | None = None) -> int | None:
        old = self.state.get(name)
        if old is None or old < status:
            self.names.append(name)
            self.olds.append(old)
            self.where.append(pos)
            self.state[name] = status
            if status == MAYBE and why is not None:
                self.why[name] = why
        return old

    def weaken(self, mark: int, why: Why, keep: set[str] | None = None) -> None:
        """Only MAYBE for what was defined since `mark`, except the names in `keep`."""
        state = self.state
        for i in range(mark, len(self.names)):
            name = self.names[i]
            if state[name] == DEF and (keep is None or name not in keep):
                state[name] = MAYBE
                self.why[name] = why

    def leave(self, mark: int, collect: bool = True) -> _Changes:
        """Undo the log back to `mark`; return what the scope changed (if `collect`)."""
        names, olds, state = self.names, self.olds, self.state
        changes: _Changes = {}
        for i in range(mark, len(names) if collect else mark):
            if names[i] not in changes:
                changes[names[i]] = (state[names[i]], self.where[i], olds[i] is None)
        for i in range(len(names) - 1, mark - 1, -1):
            old = olds[i]
            if old is None:
                del state[names[i]]
            else:
                state[names[i]] = old
        for log in (names, olds, self.where):
            del log[mark:]
        return changes

    def created(self) -> dict[str, None]:
        """The names absent when the log was last committed (a dict: ordered, for determinism)."""
        return {name: None for name, old in zip(self.names, self.olds) if old is None}

    def commit(self) -> None:
        """Keep the state as it is: it becomes the base that later scopes undo back to."""
        for log in (self.names, self.olds, self.where):
            log.clear()


@dataclass
class _Frame:
    """A block a stop_if can end early: a loop body or a task's init/do/exit."""

    stop_mark: int | None = None
    stop_pos: Pos | None = None


@dataclass
class _Read:
    """A read that found nothing; resolved once every group's effects are known."""

    name: str
    pos: Pos
    task: ir.Task
    call: ir.OpCall | None  # the op call reading it, if an op call does


@dataclass
class _Effect:
    """What a task does to its node's global workspace, merged when its group ends."""

    task: ir.Task
    changes: _Changes  # to re-apply (empty when the task's changes were left in place)
    created: dict[str, None]  # new global blobs, in order
    writes: dict[str, Pos]  # every global blob it writes, with the first write


@dataclass
class _TaskCtx:
    task: ir.Task
    private: bool
    reads: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)  # the first failing read stops a run
    # Private blobs the task creates, for `unused`: where, and by which op call (if any).
    new_pos: dict[str, Pos] = field(default_factory=dict)
    new_call: dict[str, ir.OpCall | None] = field(default_factory=dict)


# -- the analyzer --------------------------------------------------------------------------


class _Analyzer(Visitor):
    def __init__(self, ops: Mapping[str, OpSpec]):
        self.ops = ops
        self.diags: list[Diagnostic] = []
        self.flows: dict[str, _Flow] = {}
        self.flow = _Flow()
        self.ctx: _TaskCtx | None = None
        self.in_place = False  # leave the current task's global changes in place (see visit_Group)
        self.call: ir.OpCall | None = None  # the op call being walked, if any
        self.frames: list[_Frame] = []
        self.writes: list[dict[str, Pos]] = []  # per task and parallel branch: names written
        self.pending: list[list[_Changes]] = []  # per block: report definitions, seen at its end
        self.unresolved: list[_Read | None] = []
        self.plan: ir.Plan | None = None
        self.first_defs: _Definitions | None = None  # walked only to explain undefined blobs
        self.spec_info: dict[str, _SpecInfo] = {}
        self.creates: dict[tuple[str, str], dict[str, list[str]]] = {}  # (group, node) -> creators
        self.suggestions = 0

    def _emit(self, severity: str, code: str, pos: Pos, message: str, hint: str | None) -> None:
        self.diags.append(Diagnostic(severity, pos, message, code, hint))

    # -- plan and groups -------------------------------------------------------------------
    def visit_Plan(self, plan: ir.Plan) -> None:
        self.plan = plan
        if plan.max_epochs is None and not plan.stop_when:
            self._emit(
                "error", "no-stop", plan.pos, f"job {plan.job!r} has no stop condition",
                "add `max_epochs: N`, or `stop_when: [blob]` naming an output of an epoch task",
            )
        for group in plan.groups:
            self.visit(group)
        self._check_stop_when(plan)
        self._check_output_clash(plan.epoch)
        self._resolve_reads()

    def visit_Group(self, group: ir.Group) -> None:
        last_on_node = {task.node: task for task in group.tasks}
        effects: list[_Effect] = []
        for task in group.tasks:
            # Each task starts from the group's initial global workspace, so each is undone,
            # except the last one on its node: nothing on that node runs after it here.
            self.in_place = last_on_node[task.node] is task
            effects.append(self.visit(task))
        self._check_group_races(group, effects)
        # Only now may the group's global blobs be seen: its tasks ran side by side.
        for effect in effects:
            self.flow = self._flow(effect.task.node)
            self._apply(effect.changes)
            creators = self.creates.setdefault((group.name, effect.task.node), {})
            for name in effect.created:
                creators.setdefault(name, []).append(effect.task.name)
        for flow in self.flows.values():
            flow.commit()

    def _flow(self, node: str) -> _Flow:
        return self.flows.setdefault(node, _Flow())

    # -- tasks -----------------------------------------------------------------------------
    def visit_Task(self, task: ir.Task) -> _Effect:
        """Walk one task; return what it leaves in the global workspace and what it wrote."""
        self.flow = self._flow(task.node)
        self.ctx = _TaskCtx(task, task.workspace == "private")
        self.writes = [{}]
        for block in (task.init, task.do, task.exit):
            self._frame_block(block)
        self._check_outputs(task)
        writes = self.writes.pop()
        if self.ctx.private:
            self._check_unused(task)
            self.flow.leave(0, collect=False)  # its new blobs die with it
            # A private task's write to an existing global blob updates it.
            return _Effect(task, {}, {}, {n: p for n, p in writes.items() if n in self.flow.state})
        created = self.flow.created()
        changes = {} if self.in_place else self.flow.leave(0)
        return _Effect(task, changes, created, writes)

    def _frame_block(self, steps: tuple[ir.Step, ...]) -> None:
        """Run a block that a stop_if may end early; definitions after it become MAYBE."""
        frame = _Frame()
        self.frames.append(frame)
        self.visit_block(steps)
        self.frames.pop()
        self._weaken_after_stop(frame)

    def _weaken_after_stop(self, frame: _Frame) -> None:
        if frame.stop_mark is not None and frame.stop_pos is not None:
            self.flow.weaken(
                frame.stop_mark, Why("it is defined after the stop_if at line {line}", frame.stop_pos)
            )

    def _check_outputs(self, task: ir.Task) -> None:
        assert self.ctx is not None
        for out in task.outputs:
            self.ctx.reads.add(out.name)
            status = self.flow.state.get(out.name)
            if status is None:
                hint = self._suggest(out.name, self.flow.state)
                self._emit(
                    "error", "undefined-output", out.pos,
                    f"output {out.name!r} of task {task.name!r} is never defined in the task "
                    f"(nor in node {task.node!r}'s global workspace)",
                    hint
                    or f"define {out.name!r} with an op's `out` in the task, or remove it from `outputs`",
                )
            elif status == MAYBE:
                self._emit(
                    "warning", "maybe-undefined", out.pos,
                    f"output {out.name!r} of task {task.name!r} may be undefined when the task ends: "
                    + str(self.flow.why.get(out.name, "it is defined only on some paths")),
                    f"define {out.name!r} on every path, e.g. with a `const` at the start of the task",
                )

    def _check_unused(self, task: ir.Task) -> None:
        assert self.ctx is not None
        reads, outputs = self.ctx.reads, {o.name for o in task.outputs}
        for name, pos in self.ctx.new_pos.items():
            if name in reads or name in outputs:
                continue
            call = self.ctx.new_call[name]
            # An op's outputs are positional: naming an unread one is needed to reach a read one.
            if call is not None and any(o.name in reads for o in call.outs):
                continue
            self._emit(
                "warning", "unused", pos,
                f"blob {name!r} is defined but never read in private task {task.name!r}",
                "its value is dropped when the task ends: read it, add it to `outputs`, "
                "or remove the step that defines it",
            )

    # -- reads and writes ------------------------------------------------------------------
    def _read(self, ref: ir.BlobRef) -> None:
        ctx = self.ctx
        assert ctx is not None
        name = ref.name
        ctx.reads.add(name)
        status = self.flow.state.get(name)
        if status == DEF or name in ctx.reported:
            return
        ctx.reported.add(name)
        if status == MAYBE:
            self._emit(
                "warning", "maybe-undefined", ref.pos,
                f"blob {name!r} may be undefined here: "
                + str(self.flow.why.get(name, "it is defined only on some paths")),
                f"define {name!r} on every path before this read (e.g. with a `const` before it)",
            )
        else:
            self.unresolved.append(_Read(name, ref.pos, ctx.task, self.call))

    def _write(self, ref: ir.BlobRef) -> None:
        ctx = self.ctx
        assert ctx is not None
        name, pos = ref.name, ref.pos
        old = self.flow.define(name, DEF, pos)
        self.writes[-1].setdefault(name, pos)
        if old is None and ctx.private and name not in ctx.new_pos:
            ctx.new_pos[name] = pos
            ctx.new_call[name] = self.call

    def _apply(self, changes: _Changes, why: Why | None = None) -> None:
        """Re-apply what an undone scope changed (a parallel branch, a report)."""
        for name, (status, pos, _) in changes.items():
            self.flow.define(name, status, pos, why)

    # -- steps -----------------------------------------------------------------------------
    def visit_block(self, steps: tuple[ir.Step, ...]) -> None:
        self.pending.append([])
        for step in steps:
            self.visit(step)
        for changes in self.pending.pop():
            self._apply(changes)

    def visit_OpCall(self, call: ir.OpCall) -> None:
        spec = self.ops.get(call.op)
        if spec is None:
            self._emit(
                "error", "unknown-op", call.pos, f"unknown op {call.op!r}",
                did_you_mean(call.op, self.ops) or "run `jobrun ops` to list the ops",
            )
        else:
            self._check_call(call, spec)
        self.call = call
        for item in call.ins:
            if type(item) is ir.BlobRef:
                self._read(item)
        for out in call.outs:
            self._write(out)
        self.call = None

    def visit_Loop(self, loop: ir.Loop) -> None:
        if isinstance(loop.count, ir.BlobRef):
            self._read(loop.count)
        frame = _Frame()
        self.frames.append(frame)
        mark = self.flow.mark()
        if loop.index is not None:
            self._write(loop.index)
        self.visit_block(loop.body)
        self.frames.pop()
        # `loop: null` only ends at a stop_if, so its body starts at least once.
        if loop.count is None or (isinstance(loop.count, int) and loop.count > 0):
            self._weaken_after_stop(frame)
        else:
            self.flow.weaken(
                mark,
                Why("it is defined only inside the loop at line {line}, which may run 0 times", loop.pos),
            )

    def visit_StopIf(self, stop: ir.StopIf) -> None:
        self._read(stop.cond)
        frame = self.frames[-1]
        if frame.stop_mark is None:
            frame.stop_mark, frame.stop_pos = self.flow.mark(), stop.pos

    def visit_If(self, node: ir.If) -> None:
        """Every arm starts from the same state; a blob is DEF after only if every arm defines it.

        All arms but the last are undone and kept as changes; the last stays in place and is
        then weakened where another arm (or the missing `else`) leaves a blob undefined.
        """
        why = Why("it is defined only in some branches of the `if` at line {line}", node.pos)
        arms: list[_Changes] = []
        last = len(node.branches) - (node.orelse is None)
        mark = self.flow.mark()
        for i, branch in enumerate(node.branches):
            self._read(branch.cond)
            if i < last:
                arms.append(self._scoped(branch.body))
            else:
                mark = self.flow.mark()
                self.visit_block(branch.body)
        if node.orelse is not None:
            mark = self.flow.mark()
            self.visit_block(node.orelse)
        keep = None
        if node.orelse is not None:
            keep = {n for n, (status, _, _) in arms[0].items() if status == DEF} if arms else set()
            for arm in arms[1:]:
                keep &= {n for n, (status, _, _) in arm.items() if status == DEF}
        self.flow.weaken(mark, why, keep)
        for arm in arms:
            for name, (_, pos, _) in arm.items():
                self.flow.define(name, MAYBE, pos, why)

    def _scoped(self, steps: tuple[ir.Step, ...]) -> _Changes:
        """Walk steps in a scope that is undone afterwards; return what it changed."""
        mark = self.flow.mark()
        self.visit_block(steps)
        changes = self.flow.leave(mark)
        # A stop_if inside the undone scope: what gets re-applied from `mark` on must count
        # as "after the stop" (the safe side).
        for frame in self.frames:
            if frame.stop_mark is not None and frame.stop_mark > mark:
                frame.stop_mark = mark
        return changes

    def visit_Report(self, rep: ir.Report) -> None:
        # The body sees what existed before the report; its blobs appear when the block ends.
        frame = _Frame()
        self.frames.append(frame)
        mark = self.flow.mark()
        self.visit_block(rep.body)
        self._weaken_after_stop(frame)
        self.frames.pop()
        self.pending[-1].append(self.flow.leave(mark))

    def visit_Parallel(self, par: ir.Parallel) -> None:
        created: list[dict[str, Pos]] = []
        written: list[dict[str, Pos]] = []
        arms: list[_Changes] = []
        read_spans: list[tuple[int, int]] = []
        for branch in par.branches:
            self.writes.append({})
            start = len(self.unresolved)
            arm = self._scoped(branch.body)
            read_spans.append((start, len(self.unresolved)))
            writes = self.writes.pop()
            for name, pos in writes.items():
                self.writes[-1].setdefault(name, pos)
            arms.append(arm)
            created.append({n: p for n, (_, p, new) in arm.items() if new})
            written.append(writes)
        labels = [f"{b.name!r}" if b.name else f"#{i + 1}" for i, b in enumerate(par.branches)]
        self._check_branch_races(par, labels, created, written, read_spans)
        for arm in arms:
            self._apply(arm)

    def _check_branch_races(
        self, par: ir.Parallel, labels: list[str], created: list[dict[str, Pos]],
        written: list[dict[str, Pos]], read_spans: list[tuple[int, int]],
    ) -> None:
        creator: dict[str, int] = {}
        for i, names in enumerate(created):
            for name, pos in names.items():
                if name in creator:
                    self._emit(
                        "error", "race", pos,
                        f"blob {name!r} is created by two concurrent branches of the `parallel` "
                        f"at line {par.pos.line} (branches {labels[creator[name]]} and {labels[i]})",
                        f"create {name!r} before the `parallel` step, or give each branch its own blob",
                    )
                else:
                    creator[name] = i
        writer: dict[str, int] = {}
        for i, names in enumerate(written):
            for name, pos in names.items():
                if name not in self.flow.state:
                    continue
                if name in writer:
                    self._emit(
                        "warning", "race", pos,
                        f"blob {name!r} is written by two concurrent branches of the `parallel` at "
                        f"line {par.pos.line} (branches {labels[writer[name]]} and {labels[i]})",
                        "the result depends on which branch writes last: let one branch own it",
                    )
                else:
                    writer[name] = i
        for i, (start, end) in enumerate(read_spans):
            for k in range(start, end):
                read = self.unresolved[k]
                if read is None or creator.get(read.name, i) == i:
                    continue
                self.unresolved[k] = None
                self._emit(
                    "warning", "race", read.pos,
                    f"branch {labels[i]} reads {read.name!r}, which the concurrent branch "
                    f"{labels[creator[read.name]]} creates: it may not exist yet",
                    f"create {read.name!r} before the `parallel` step",
                )

    # -- op calls --------------------------------------------------------------------------
    def _check_call(self, call: ir.OpCall, spec: OpSpec) -> None:
        info = self.spec_info.get(spec.name) or self.spec_info.setdefault(spec.name, _SpecInfo(spec))
        if not info.fits(info.ins, len(call.ins)):
            self._bad_count(call, spec, info.ins, len(call.ins), "input", "in-count")
        if not info.fits(info.outs, len(call.outs)):
            self._bad_count(call, spec, info.outs, len(call.outs), "output", "out-count")
        for key, value in call.args:
            self._check_arg(call, spec, key, value)
        if not info.required:
            return
        given = {key for key, _ in call.args}
        for a in info.required:
            if a.name not in given:
                self._emit(
                    "error", "missing-arg", call.pos,
                    f"`{call.op}` needs argument `{a.name}`",
                    f"add `{a.name}: ...` ({_describe(a.type)}); {_op_hint(spec)}",
                )

    def _bad_count(
        self, call: ir.OpCall, spec: OpSpec, bounds: tuple[int, int | None], n: int, word: str, code: str
    ) -> None:
        self._emit(
            "error", code, call.pos,
            f"`{call.op}` takes {_bounds_text(*bounds, word)}, got {n}", _op_hint(spec),
        )

    def _check_arg(self, call: ir.OpCall, spec: OpSpec, key: str, value: Any) -> None:
        a = spec.arg(key)
        pos = call.pos_of(key)
        if a is None:
            if not spec.extra_args:
                known = [x.name for x in spec.args]
                self._emit(
                    "error", "unknown-arg", pos, f"`{call.op}` has no argument `{key}`",
                    did_you_mean(key, known)
                    or (f"its arguments are: {', '.join(known)}" if known
                        else f"`{call.op}` takes no arguments"),
                )
            return
        if not _type_ok(value, a.type):
            self._emit(
                "error", "arg-type", pos,
                f"argument `{key}` of `{call.op}` is {_show(value)}; expected {_describe(a.type)}",
                _type_hint(key, value, a.type),
            )
        elif _mentions_shape(a.type) and _CHECKS["shape"](value):
            size = math.prod(value)
            if size > MAX_SHAPE_ELEMENTS:
                self._emit(
                    "error", "arg-value", pos,
                    f"shape {_show(value)} of `{call.op}` has {size} elements, "
                    f"more than the {MAX_SHAPE_ELEMENTS} (2**34) allowed",
                    "check the dimensions: a tensor this large cannot fit in memory",
                )

    # -- plan-level checks -----------------------------------------------------------------
    def _check_group_races(self, group: ir.Group, effects: list[_Effect]) -> None:
        by_node: dict[str, list[_Effect]] = {}
        for effect in effects:
            by_node.setdefault(effect.task.node, []).append(effect)
        for node, tasks in by_node.items():
            if len(tasks) < 2:
                continue  # nodes have separate workspaces: only tasks sharing one can race
            writers: dict[str, list[tuple[ir.Task, Pos, bool]]] = {}
            for effect in tasks:
                for name, pos in effect.writes.items():
                    writers.setdefault(name, []).append((effect.task, pos, name in effect.created))
            for name, who in writers.items():
                if len(who) > 1:
                    self._report_race(group, node, name, who)

    def _report_race(
        self, group: ir.Group, node: str, name: str, who: list[tuple[ir.Task, Pos, bool]]
    ) -> None:
        creators = [w for w in who if w[2]]
        severity, verb, (first, second) = (
            ("error", "created", creators[:2]) if len(creators) > 1 else ("warning", "written", who[:2])
        )
        self._emit(
            severity, "race", second[1],
            f"blob {name!r} is {verb} in node {node!r}'s global workspace by tasks "
            f"{first[0].name!r} and {second[0].name!r} of group `{group.name}`, which run concurrently",
            f"let one task own {name!r}, or create it in an earlier group and hand results over "
            "through `outputs`",
        )

    def _check_stop_when(self, plan: ir.Plan) -> None:
        outputs = [o.name for t in plan.epoch.tasks for o in t.outputs]
        for ref in plan.stop_when:
            if ref.name not in outputs:
                self._emit(
                    "error", "stop-when", ref.pos,
                    f"stop_when names {ref.name!r}, which is not an output of any epoch task",
                    did_you_mean(ref.name, outputs)
                    or f"add {ref.name!r} to the `outputs` of the epoch task that computes it",
                )

    def _check_output_clash(self, group: ir.Group) -> None:
        owner: dict[str, ir.Task] = {}
        for task in group.tasks:
            for out in task.outputs:
                first = owner.setdefault(out.name, task)
                if first is not task:
                    self._emit(
                        "warning", "output-clash", out.pos,
                        f"output {out.name!r} of task {task.name!r} is also an output of task "
                        f"{first.name!r} (line {first.pos.line})",
                        "the runner keeps one value per output name: rename one of them",
                    )

    def _resolve_reads(self) -> None:
        for read in self.unresolved:
            if read is None:
                continue
            task = read.task
            creators = self.creates.get((task.group, task.node), {}).get(read.name, [])
            others = [c for c in creators if c != task.name]
            if others:
                self._emit(
                    "warning", "group-order", read.pos,
                    f"task {task.name!r} reads {read.name!r}, which task {others[0]!r} of the same "
                    f"group `{task.group}` creates; tasks of a group run concurrently",
                    f"create {read.name!r} in an earlier group (e.g. `init`) or in task {task.name!r}",
                )
            elif creators and task.group == "epoch":
                self._emit(
                    "warning", "maybe-undefined", read.pos,
                    f"blob {read.name!r} is undefined in the first epoch: task {task.name!r} creates "
                    f"it only after this read, so it exists from the second epoch on",
                    f"create {read.name!r} in `init`, or before this read",
                )
            else:
                self._emit(
                    "error", "undefined-blob", read.pos,
                    f"blob {read.name!r} is read before it is defined (task {task.name!r}, "
                    f"node {task.node!r})",
                    self._undefined_hint(read),
                )

    def _undefined_hint(self, read: _Read) -> str:
        if self.first_defs is None:
            self.first_defs = _Definitions()
            self.first_defs.visit(self.plan)
        name, task = read.name, read.task
        here = self.first_defs.found.get(task.node, {})
        first = here.get(name)
        # `add: {in: [n, 1], out: n}` with no n before: its own output explains nothing.
        in_place = first is not None and read.call is not None and first[0] in {
            o.pos for o in read.call.outs if o.name == name
        }
        if first is not None and not in_place:
            pos, by, in_report = first
            if in_report:
                return (f"{name!r} is defined at line {pos.line} inside a `report`, whose blobs "
                        f"appear only when the report's enclosing block ends: read it after that")
            if by is not task and by.workspace == "private":
                return (f"{name!r} is defined at line {pos.line} in private task {by.name!r}, whose "
                        f"new blobs are dropped when it ends: make it `workspace: global`, "
                        f"or define {name!r} in `init`")
            return (f"{name!r} is first defined at line {pos.line}, which does not run before "
                    f"this read: define it earlier")
        for node, names in sorted(self.first_defs.found.items()):
            if name in names and node != task.node:
                return (f"{name!r} is defined on node {node!r} (line {names[name][0].line}); each "
                        f"node has its own workspace: define it on node {task.node!r} too")
        if in_place:
            return f"this step updates {name!r} in place, but nothing creates it first: add e.g. a `const` in `init`"
        return self._suggest(name, here) or f"define {name!r} first, e.g. with an op's `out` in `init`"

    def _suggest(self, name: str, names: Mapping[str, Any]) -> str | None:
        if self.suggestions >= _MAX_SUGGESTIONS:
            return None
        self.suggestions += 1
        return did_you_mean(name, names)


class _SpecInfo:
    """What every call of one op is checked against, computed once per op."""

    def __init__(self, spec: OpSpec):
        self.ins = spec.input_bounds
        self.outs = spec.output_bounds
        self.required = tuple(a for a in spec.args if a.required)

    @staticmethod
    def fits(bounds: tuple[int, int | None], n: int) -> bool:
        lo, hi = bounds
        return lo <= n and (hi is None or n <= hi)


class _Definitions(Visitor):
    """Where each blob is first defined on each node (and whether inside a `report`)."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, tuple[Pos, ir.Task, bool]]] = {}
        self.task: ir.Task | None = None
        self.in_report = False

    def visit_Task(self, task: ir.Task) -> None:
        self.task = task
        self.generic_visit(task)

    def visit_OpCall(self, call: ir.OpCall) -> None:
        for out in call.outs:
            self._add(out)

    def visit_Loop(self, loop: ir.Loop) -> None:
        if loop.index is not None:
            self._add(loop.index)
        self.generic_visit(loop)

    def visit_Report(self, rep: ir.Report) -> None:
        outer, self.in_report = self.in_report, True
        self.generic_visit(rep)
        self.in_report = outer

    def _add(self, ref: ir.BlobRef) -> None:
        assert self.task is not None
        names = self.found.setdefault(self.task.node, {})
        names.setdefault(ref.name, (ref.pos, self.task, self.in_report))
