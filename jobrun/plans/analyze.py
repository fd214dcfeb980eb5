"""Static checks of a compiled plan: a list of diagnostics, never an exception, never torch.

`analyze(plan)` walks the job in the order the runner executes it::

    for group in init, epoch, download, exit:
        for task in group:              # concurrent: each starts from the group's global state
            walk init, do, exit         # check op calls, read and define blobs
        merge what global-workspace tasks created into their node's global workspace
    resolve the reads that found nothing (same-group writers, later epochs), stop conditions

Each op call is checked against its op's signature (:mod:`jobrun.plans.signatures`); the
walk is a data-flow analysis over :mod:`jobrun.plans.flow`'s workspace model: reads before
definitions, races of concurrent tasks and branches, outputs, stop conditions, unread blobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobrun.errors import Pos, did_you_mean, with_origin
from jobrun.ops.spec import OpSpec
from jobrun.plans import analyze_data, ir, precision
from jobrun.plans.compare import Kinds
from jobrun.plans.flow import DEF, MAYBE, Changes, Definitions, Effect, Flow, Frame, Read, TaskCtx
from jobrun.plans.signatures import Signatures
from jobrun.plans.visit import Visitor, also_written

_MAX_SUGGESTIONS = 50  # difflib is slow on huge name sets: bound the cost of hints


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning"
    pos: Pos
    message: str
    code: str
    hint: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hint", with_origin(self.hint, self.pos))

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
    for f in analyzer.kinds.findings(plan):
        analyzer._emit(f.severity, f.code, f.pos, f.message, f.hint)
    _check_checkpointed(plan, ops, analyzer.diags)
    for code, pos, message, hint in precision.problems(plan):
        analyzer.diags.append(Diagnostic("warning", pos, message, code, hint))
    # Severity, code and message break ties so that the order never depends on the walk.
    return sorted(
        analyzer.diags,
        key=lambda d: (d.pos.file, d.pos.line, d.pos.col, d.severity != "error", d.code, d.message),
    )


def _check_checkpointed(plan: ir.Plan, ops: Mapping[str, OpSpec], diags: list[Diagnostic]) -> None:
    """Worked out apart: what checkpoints hold (plans/state.py), instances training one model,
    data, empty bodies, endless loops, checkpoint.load and the outputs epoch tasks hand over."""
    from jobrun.plans import (
        analyze_bodies,
        analyze_data,
        analyze_loads,
        analyze_outputs,
        collectives,
        instances,
        state,
    )
    diags += [Diagnostic(s, p, m, "checkpoint-blob", h) for s, p, m, h in state.problems(plan, ops)]
    diags += [Diagnostic("error", p, m, "instance-training", h) for p, m, h in instances.problems(plan, ops)]
    if plan.replicas == "auto" or plan.replicas > 1:  # `train --replicas N` is refused by launch
        severity = "warning" if plan.replicas == "auto" else "error"
        diags += [Diagnostic(severity, p, m, "concurrent-collectives", h) for p, m, h in collectives.problems(plan)]
    diags += [Diagnostic(s, p, m, c, h) for s, c, p, m, h in analyze_data.problems(plan)]
    diags += [Diagnostic(s, p, m, c, h) for s, c, p, m, h in analyze_bodies.problems(plan)]
    diags += [Diagnostic(s, p, m, c, h) for s, c, p, m, h in analyze_loads.problems(plan, ops)]
    diags += [Diagnostic(s, p, m, c, h) for s, c, p, m, h in analyze_outputs.problems(plan)]


# -- the analyzer --------------------------------------------------------------------------


class _Analyzer(Visitor):
    def __init__(self, ops: Mapping[str, OpSpec]):
        self.signatures = Signatures(ops)
        self.diags: list[Diagnostic] = []
        self.flows: dict[str, Flow] = {}
        self.flow = Flow()
        self.ctx: TaskCtx | None = None
        self.in_place = False  # leave the current task's global changes in place (see visit_Group)
        self.call: ir.OpCall | None = None  # the op call being walked, if any
        self.frames: list[Frame] = []
        self.loops: list[int] = []  # the lines of the loops being walked, innermost last
        self.writes: list[dict[str, Pos]] = []  # per task and parallel branch: names written
        self.pending: list[list[Changes]] = []  # per block: report definitions, seen at its end
        self.unresolved: list[Read | None] = []
        self.plan: ir.Plan | None = None
        self.pass_readers: set[tuple[str, str]] = set()  # see analyze_data.pass_readers
        self.first_defs: Definitions | None = None  # walked only to explain undefined blobs
        self.creates: dict[tuple[str, str], dict[str, list[str]]] = {}  # (group, node) -> creators
        self.suggestions = 0
        self.kinds = Kinds()

    def _emit(self, severity: str, code: str, pos: Pos, message: str, hint: str | None) -> None:
        self.diags.append(Diagnostic(severity, pos, message, code, hint))

    # -- plan and groups -------------------------------------------------------------------
    def visit_Plan(self, plan: ir.Plan) -> None:
        self.plan = plan
        self.pass_readers = analyze_data.pass_readers(plan)
        if plan.max_epochs is None and plan.max_steps is None and not (plan.stop_when or plan.early_stop):
            self._emit(
                "error", "no-stop", plan.pos, f"job {plan.job!r} has no stop condition",
                "add `max_epochs: N`, `max_steps: N`, `stop_when: [blob]` or `early_stop: {monitor: blob}`",
            )
        for group in plan.groups:
            self.visit(group)
        self._resolve_reads()

    def visit_Group(self, group: ir.Group) -> None:
        last_on_node = {task.node: task for task in group.tasks}
        effects: list[Effect] = []
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

    def _flow(self, node: str) -> Flow:
        return self.flows.setdefault(node, Flow())

    # -- tasks -----------------------------------------------------------------------------
    def visit_Task(self, task: ir.Task) -> Effect:
        """Walk one task; return what it leaves in the global workspace and what it wrote."""
        self.flow = self._flow(task.node)
        self.ctx = TaskCtx(task, task.workspace == "private")
        self.writes = [{}]
        for block in (task.init, task.do, task.exit):
            instanced = block is task.do and task.instances > 1
            if instanced:
                self.ctx.shared, mark = set(self.flow.state), self.flow.mark()
            self._frame_block(block)
            if instanced:  # each instance's own workspace: the names it creates die with it
                self._apply({n: c for n, c in self.flow.leave(mark).items() if not c[2]})
            self.ctx.shared = None
        self._check_outputs(task)
        writes = self.writes.pop()
        if self.ctx.private:
            self._check_unused(task)
            self.flow.leave(0, collect=False)  # its new blobs die with it
            # A private task's write to an existing global blob updates it.
            return Effect(task, {}, {}, {n: p for n, p in writes.items() if n in self.flow.state})
        created = self.flow.created()
        changes = {} if self.in_place else self.flow.leave(0)
        return Effect(task, changes, created, writes)

    def _frame_block(self, steps: tuple[ir.Step, ...]) -> None:
        """Run a block that a stop_if may end early; definitions after it become MAYBE."""
        frame = Frame()
        self.frames.append(frame)
        self.visit_block(steps)
        self.frames.pop()
        self._weaken_after_stop(frame)

    def _weaken_after_stop(self, frame: Frame) -> None:
        if frame.stop_mark is not None and frame.stop_pos is not None:
            self.flow.weaken(frame.stop_mark, f"it is defined after the stop_if at line {frame.stop_pos.line}")

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
                    f"(nor in the global workspace of node {task.node!r})",
                    hint
                    or f"define {out.name!r} with an op's `out` in the task, or remove it from `outputs`",
                )
            elif status == MAYBE:
                self._emit(
                    "warning", "maybe-undefined", out.pos,
                    f"output {out.name!r} of task {task.name!r} may be undefined when the task ends: "
                    + self.flow.why.get(out.name, "it is defined only on some paths"),
                    f"define {out.name!r} on every path, e.g. with a `const` at the start of the task",
                )

    def _check_unused(self, task: ir.Task) -> None:
        assert self.ctx is not None
        reads, outputs = self.ctx.reads, {o.name for o in task.outputs}
        for name, pos in self.ctx.new_pos.items():
            if name in reads or name in outputs:
                continue
            call = self.ctx.new_call[name]
            # Outputs are positional (an unread one is named to reach a read one); train.step's
            # `<loss>_last` is no name of the plan's (its loss is warned of).
            if call is not None and (any(o.name in reads for o in call.outs)
                                     or any(r.name == name for r in also_written(call))):
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
                + self.flow.why.get(name, "it is defined only on some paths"),
                f"define {name!r} on every path before this read (e.g. with a `const` before it)",
            )
        else:
            self.unresolved.append(Read(name, ref.pos, ctx.task, self.call, self.loops[-1] if self.loops else None))

    def _write(self, ref: ir.BlobRef) -> None:
        ctx = self.ctx
        assert ctx is not None
        name, pos = ref.name, ref.pos
        if ctx.shared is not None and name in ctx.shared and name not in ctx.shared_warned:
            ctx.shared_warned.add(name)
            self._emit(
                "warning", "instance-race", pos,
                f"the {ctx.task.instances} instances of task {ctx.task.name!r} all write {name!r}, "
                "which they share: updates can be lost",
                "give each instance its own name (new names stay in the instance), or update it "
                "once in the task's `exit`",
            )
        old = self.flow.define(name, DEF, pos)
        self.writes[-1].setdefault(name, pos)
        if old is None and ctx.private and name not in ctx.new_pos:
            ctx.new_pos[name] = pos
            ctx.new_call[name] = self.call

    def _apply(self, changes: Changes, why: str | None = None) -> None:
        """Re-apply what an undone scope changed (a parallel branch, a report)."""
        for name, (status, pos, _) in changes.items():
            self.flow.define(name, status, pos, why)

    # -- steps -----------------------------------------------------------------------------
    def visit_block(self, steps: tuple[ir.Step, ...]) -> None:
        self.pending.append([])
        seen: dict[int, set[str]] = {}  # what the steps with `every: N` of the block define
        for step in steps:
            self.visit(step) if step.every is None else self.flow.every(step, seen, self.visit)
        for changes in self.pending.pop():
            self._apply(changes)

    def visit_OpCall(self, call: ir.OpCall) -> None:
        for problem in self.signatures.check(call):
            self._emit("error", problem.code, problem.pos, problem.message, problem.hint)
        self.call = call
        for item in call.ins:
            if type(item) is ir.BlobRef:
                self._read(item)
        for out in (*call.outs, *also_written(call)):
            self._write(out)
        self.call = None
        assert self.ctx is not None
        self.kinds.op(self.ctx.task.node, call)

    def visit_Loop(self, loop: ir.Loop) -> None:
        assert self.ctx is not None
        node = self.ctx.task.node
        if isinstance(loop.count, ir.BlobRef):
            self._read(loop.count)
            self.kinds.count(node, loop.count)
        frame = Frame(after_batch=analyze_data.first_batch_stop(loop, node, self.pass_readers))
        self.frames.append(frame)
        mark = self.flow.mark()
        if loop.index is not None:
            self._write(loop.index)
            self.kinds.index(node, loop.index)
        self.loops.append(loop.pos.line)
        self.visit_block(loop.body)
        self.loops.pop()
        self.frames.pop()
        # `loop: null` only ends at a stop_if, so its body starts at least once; what it
        # defines after a stop_if that cannot end its first iteration is defined after it.
        if loop.count is None or (isinstance(loop.count, int) and loop.count > 0):
            self._weaken_after_stop(frame)
        else:
            self.flow.weaken(
                mark, f"it is defined only inside the loop at line {loop.pos.line}, which may run 0 times"
            )

    def visit_StopIf(self, stop: ir.StopIf) -> None:
        self._read(stop.cond)
        frame = self.frames[-1]
        if frame.stop_mark is None and stop is not frame.after_batch:
            frame.stop_mark, frame.stop_pos = self.flow.mark(), stop.pos

    def visit_If(self, node: ir.If) -> None:
        """Every arm starts from the same state; a blob is DEF after only if every arm defines it.

        All arms but the last are undone and kept as changes; the last stays in place and is
        then weakened where another arm (or the missing `else`) leaves a blob undefined.
        """
        why = f"it is defined only in some branches of the `if` at line {node.pos.line}"
        arms: list[Changes] = []
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

    def _scoped(self, steps: tuple[ir.Step, ...]) -> Changes:
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
        frame = Frame()
        self.frames.append(frame)
        mark = self.flow.mark()
        self.visit_block(rep.body)
        self._weaken_after_stop(frame)
        self.frames.pop()
        self.pending[-1].append(self.flow.leave(mark))

    def visit_Parallel(self, par: ir.Parallel) -> None:
        created: list[dict[str, Pos]] = []
        written: list[dict[str, Pos]] = []
        arms: list[Changes] = []
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

    # -- plan-level checks -----------------------------------------------------------------
    def _check_group_races(self, group: ir.Group, effects: list[Effect]) -> None:
        by_node: dict[str, list[Effect]] = {}
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
            f"blob {name!r} is {verb} in the global workspace of node {node!r} by tasks "
            f"{first[0].name!r} and {second[0].name!r} of group `{group.name}`, which run concurrently",
            f"let one task own {name!r}, or create it in an earlier group and hand results over "
            "through `outputs`",
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

    def _undefined_hint(self, read: Read) -> str:
        if self.first_defs is None:
            self.first_defs = Definitions()
            self.first_defs.visit(self.plan)
        return self.first_defs.hint(read) or self._suggest(read.name, self.first_defs.found.get(
            read.task.node, {}), read.task) or f"define {read.name!r} first, e.g. with an op's `out` in `init`"

    def _suggest(self, name: str, names: Mapping[str, Any], task: ir.Task | None = None) -> str | None:
        """`task`: where `name` is read (`names` say where each was first made): a typo
        of a blob that task made is suggested first."""
        if self.suggestions >= _MAX_SUGGESTIONS:
            return None
        self.suggestions += 1
        near = [n for n, (_, by, _) in names.items() if by is task] if task is not None else ()
        return did_you_mean(name, names, near=near)
