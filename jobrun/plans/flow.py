"""The workspace model the analyzer (:mod:`jobrun.plans.analyze`) walks a plan with.

Definedness is tracked per node as ``name -> DEF | MAYBE`` in one dict with an undo log
(:class:`Flow`). A scope (an `if` arm, a parallel branch, a private workspace) is a mark
in that log: leaving it undoes its entries and hands back what it changed; a scope that
may not run to its end (a loop that may run 0 times, code after a stop_if) lowers its own
entries to MAYBE in place. A step costs O(1) and no workspace is ever copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.visit import Visitor

MAYBE, DEF = 1, 2  # ordered: a later definition can only make a blob more defined

Changes = dict[str, tuple[int, Pos, bool]]  # name -> (status, first definition, newly created)


class Flow:
    """The blobs one node's tasks can see: a dict plus an undo log of its changes.

    Statuses only grow (absent -> MAYBE -> DEF) through `define`; a scope that turns out
    to be conditional lowers its own entries in place with `weaken`.
    """

    def __init__(self) -> None:
        self.state: dict[str, int] = {}
        self.why: dict[str, str] = {}  # why a blob is only MAYBE defined
        # The log is parallel lists, not a list of tuples: a tuple per definition would make
        # the garbage collector rescan the whole plan every few thousand steps.
        self.names: list[str] = []
        self.olds: list[int | None] = []
        self.where: list[Pos] = []

    def mark(self) -> int:
        return len(self.names)

    def every(self, step: ir.Step, seen: dict[int, set[str]], visit: Callable[[ir.Step], None]) -> None:
        """Walk a step with `every: N` (`visit`): it runs at some steps only, so what it
        defines is MAYBE after it (as after an `if` without `else`), except to the later
        steps of its block with the same N (`seen`: what those define), which run with it."""
        n = step.every or 1
        mark = self.mark()
        same = {name: self.state[name] for name in seen.get(n, ()) if self.state.get(name) == MAYBE}
        self.state.update(dict.fromkeys(same, DEF))
        visit(step)
        self.state.update(same)
        seen.setdefault(n, set()).update(self.names[mark:])
        self.weaken(mark, f"the step at line {step.pos.line} runs every {n} steps only")

    def define(self, name: str, status: int, pos: Pos, why: str | None = None) -> int | None:
        old = self.state.get(name)
        if old is None or old < status:
            self.names.append(name)
            self.olds.append(old)
            self.where.append(pos)
            self.state[name] = status
            if status == MAYBE and why is not None:
                self.why[name] = why
        return old

    def weaken(self, mark: int, why: str, keep: set[str] | None = None) -> None:
        """Only MAYBE for what was defined since `mark`, except the names in `keep`."""
        state = self.state
        for i in range(mark, len(self.names)):
            name = self.names[i]
            if state[name] == DEF and (keep is None or name not in keep):
                state[name] = MAYBE
                self.why[name] = why

    def leave(self, mark: int, collect: bool = True) -> Changes:
        """Undo the log back to `mark`; return what the scope changed (if `collect`)."""
        names, olds, state = self.names, self.olds, self.state
        changes: Changes = {}
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
class Frame:
    """A block a stop_if can end early: a loop body or a task's init/do/exit."""

    stop_mark: int | None = None
    stop_pos: Pos | None = None
    after_batch: ir.StopIf | None = None  # a stop_if that cannot end the loop's first iteration


@dataclass
class Read:
    """A read that found nothing; resolved once every group's effects are known."""

    name: str
    pos: Pos
    task: ir.Task
    call: ir.OpCall | None  # the op call reading it, if an op call does
    loop: int | None = None  # the line of the innermost loop it is read in


@dataclass
class Effect:
    """What a task does to its node's global workspace, merged when its group ends."""

    task: ir.Task
    changes: Changes  # to re-apply (empty when the task's changes were left in place)
    created: dict[str, None]  # new global blobs, in order
    writes: dict[str, Pos]  # every global blob it writes, with the first write


@dataclass
class TaskCtx:
    """What the analyzer keeps of the task it is walking."""

    task: ir.Task
    private: bool
    reads: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)  # the first failing read stops a run
    # Private blobs the task creates, for `unused`: where, and by which op call (if any).
    new_pos: dict[str, Pos] = field(default_factory=dict)
    new_call: dict[str, ir.OpCall | None] = field(default_factory=dict)
    # With `instances` > 1, while walking `do`: the names its instances share (the global
    # ones and the task's own from `init`), and those already warned about.
    shared: set[str] | None = None
    shared_warned: set[str] = field(default_factory=set)


class Definitions(Visitor):
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

    def hint(self, read: Read) -> str | None:
        """Why the blob ``read`` found nothing is defined there, when this walk can tell."""
        name, task = read.name, read.task
        first = self.found.get(task.node, {}).get(name)
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
            if by.instances > 1:
                return (f"{name!r} is defined at line {pos.line} in task {by.name!r}, whose "
                        f"{by.instances} instances each have a workspace of their own, dropped when "
                        f"they end: define {name!r} before them (an instance may update it)")
            return (f"{name!r} is first defined at line {pos.line}, which does not run before "
                    f"this read: define it earlier")
        for node, names in sorted(self.found.items()):
            if name in names and node != task.node:
                return (f"{name!r} is defined on node {node!r} (line {names[name][0].line}); each "
                        f"node has its own workspace: define it on node {task.node!r} too")
        if in_place and read.loop is not None:  # a value carried from one iteration to the next
            return (f"this step reads {name!r} and writes it back, but nothing gives it a first value: "
                    f"create it before the loop at line {read.loop}, where it starts afresh each time "
                    f"the task runs (an RNN's hidden state, every epoch), or in `init` to carry it over "
                    f"from one epoch to the next")
        if in_place:
            return f"this step updates {name!r} in place, but nothing creates it first: add e.g. a `const` in `init`"
        return None
