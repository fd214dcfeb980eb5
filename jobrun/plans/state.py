"""What a checkpoint holds: the global blobs that steps after `init` write or change.

Resume runs `init` again, so what `init` builds and no later step touches (data, data
sets, constants, an evaluation reader) is rebuilt, not loaded. Per node::

    changed  = blobs an epoch step writes (`out`, a loop's `as`)
             + inputs an epoch step changes in place (its op's `mutates`; users' ops
               without a declaration: every input; `call: {mutates: [...]}` says which;
               a `call` that does not: its inputs that are not data, i.e. not made by
               an op of DATA_OPS nor by a `pure: true` call; `pure: true`: none)
             + what a changed blob holds on to (its op's `keeps`: a scheduler its
               optimizer; `build` and undeclared ops: every input; a pure call: none),
               until nothing new
    held     = (changed + checkpoint.include - checkpoint.exclude) & global blobs

Global blobs are the names that global-workspace tasks of `init` and `epoch` create; an
epoch task's write reaches the global workspace when the name is one of them. All of it
is static (from the plan and the ops' signatures) and never imports torch. The runner
saves the random state besides; a blob that `exclude` drops, or that init builds with
random draws, is checked on resume by the fingerprint of init's products.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobrun.errors import Pos, did_you_mean
from jobrun.ops.spec import OpSpec
from jobrun.plans import ir
from jobrun.plans.visit import Visitor


def checkpointed(plan: ir.Plan, ops: Mapping[str, OpSpec] | None = None) -> dict[str, tuple[str, ...]]:
    """Per node (every node of the plan), the blobs its checkpoints hold, in plan order."""
    walk = _walk(plan, ops)
    ckpt = plan.checkpoint
    include = {ref.name for ref in ckpt.include} if ckpt else set()
    exclude = {ref.name for ref in ckpt.exclude} if ckpt else set()
    out: dict[str, tuple[str, ...]] = {}
    for node in plan.nodes:
        names = walk.globals.get(node, {})
        changed = walk.closure(node) | include
        out[node] = tuple(n for n in names if n in changed and n not in exclude)
    return out


def problems(plan: ir.Plan, ops: Mapping[str, OpSpec] | None = None) -> list[tuple[str, Pos, str, str]]:
    """(severity, pos, message, hint) of each problem: a name in a call's `mutates` that is
    not one of its inputs (an error: a typo left what the call changes out of every
    checkpoint, and a resume silently gave another result), a name of
    checkpoint.include/exclude that no node's global workspace holds (a warning: a typo,
    or a private blob, gone before any save)."""
    walk = _walk(plan, ops)
    found = [("error", *bad) for bad in walk.bad_mutates]
    if plan.checkpoint is None:
        return found
    known: dict[str, None] = {}
    for names in walk.globals.values():
        known.update(names)
    for key in ("include", "exclude"):
        for ref in getattr(plan.checkpoint, key):
            if ref.name not in known:
                found.append((
                    "warning", ref.pos,
                    f"checkpoint.{key} names blob {ref.name!r}, which no global workspace holds",
                    did_you_mean(ref.name, known) or "checkpoints hold the blobs of global "
                    "workspaces; a private task's blobs are gone before any save",
                ))
    return found


def _walk(plan: ir.Plan, ops: Mapping[str, OpSpec] | None) -> _Walk:
    if ops is None:
        from jobrun.ops.registry import registry

        ops = registry()
    walk = _Walk(ops)
    walk.visit(plan)
    return walk


class _Walk(Visitor):
    """Collects, per node: global blobs, blobs changed by epoch steps, and `keeps` links."""

    def __init__(self, ops: Mapping[str, OpSpec]) -> None:
        self.ops = ops
        self.globals: dict[str, dict[str, None]] = {}  # node -> names, in order of creation
        self.changed: dict[str, set[str]] = {}
        # Blobs a private epoch task writes: dropped when the task ends, unless the name
        # is a global blob (the write then reaches the global workspace); see closure.
        self.private: dict[str, set[str]] = {}
        self.kept: dict[str, dict[str, set[str]]] = {}  # node -> blob -> blobs it holds on to
        self.group = ""
        self.task: ir.Task | None = None
        self.bad_mutates: list[tuple[Pos, str, str]] = []
        self.data: dict[str, set[str]] = {}  # node -> blobs that hold data (see DATA_OPS)

    def visit_Group(self, group: ir.Group) -> None:
        if group.name in ("init", "epoch"):  # download and exit run after the last save
            self.group = group.name
            self.generic_visit(group)

    def visit_Task(self, task: ir.Task) -> None:
        self.task = task
        self.globals.setdefault(task.node, {})
        self.changed.setdefault(task.node, set())
        self.private.setdefault(task.node, set())
        self.kept.setdefault(task.node, {})
        self.generic_visit(task)

    def _wrote(self, name: str) -> None:
        task = self.task
        assert task is not None
        if task.workspace == "global":
            self.globals[task.node].setdefault(name, None)
        if self.group == "epoch":
            (self.changed if task.workspace == "global" else self.private)[task.node].add(name)

    def visit_Loop(self, loop: ir.Loop) -> None:
        if loop.index is not None:
            self._wrote(loop.index.name)
        self.generic_visit(loop)

    def visit_OpCall(self, call: ir.OpCall) -> None:
        task = self.task
        assert task is not None
        spec = self.ops.get(call.op)
        names = spec.input_names(len(call.ins)) if spec is not None else [""] * len(call.ins)
        blobs = [(i.name, n) for i, n in zip(call.ins, names) if isinstance(i, ir.BlobRef)]
        listed = self._listed(call, [b for b, _ in blobs])
        pure = is_pure(call)
        data = self.data.setdefault(task.node, set())
        if self.group == "epoch":
            changed = self.changed[task.node]
            if listed is not None:
                changed.update(b for b, _ in blobs if b in listed)
            elif call.op == "call":  # undeclared: it may change what is not data
                changed.update(b for b, _ in blobs if not pure and b not in data)
            else:
                changed.update(b for b, n in blobs if _declared(spec, "mutates", n))
            if call.op == "evaluate" and call.kwargs.get("batches") is not None:
                changed.update(b for b, n in blobs if n == "reader")  # it reads on, as `read`
        kept = set() if pure else {b for b, n in blobs if _declared(spec, "keeps", n)}
        for out in call.outs:
            self._wrote(out.name)
            if pure or call.op in DATA_OPS:
                data.add(out.name)
            else:
                data.discard(out.name)
            if kept:
                self.kept[task.node].setdefault(out.name, set()).update(kept)

    def _listed(self, call: ir.OpCall, inputs: list[str]) -> list[Any] | None:
        listed = call_mutates(call)
        task = self.task
        made = self.globals.get(task.node, {}) if task is not None else {}
        for name in listed or ():
            if name not in inputs:
                near = did_you_mean(name, inputs)
                if near and name in made:  # `in` misspells a blob there is (`emma` for `ema`)
                    near = f"did you mean {name!r} in `in`, where it says {near[len('did you mean '):-1]}?"
                self.bad_mutates.append((
                    call.pos_of("mutates"),
                    f"`call` says it changes {name!r}, which is not one of its inputs",
                    near or f"`mutates` lists blob names of its `in`: {inputs}",
                ))
        return listed

    def closure(self, node: str) -> set[str]:
        """The changed blobs of `node` and, transitively, what they hold on to. A private
        task's new blob is no start: it is gone before any save, so what it holds on to
        (a `call`'s batch, its token stream) stays as init made it, unless a step changes
        the blob in place (which reaches what it holds) or the name is global."""
        kept = self.kept.get(node, {})
        seen: set[str] = set()
        todo = [*self.changed.get(node, ()),
                *(n for n in self.private.get(node, ()) if n in self.globals.get(node, {}))]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(kept.get(name, ()))
        return seen


def _declared(spec: OpSpec | None, field: str, input_name: str) -> bool:
    """Whether the input named `input_name` (in `spec`) is in the op's `field` list."""
    if spec is None:
        return True  # an unknown op (analyze reports it): assume the worst
    declared: Any = getattr(spec, field)
    return declared is None or input_name in declared


# Ops whose outputs are data (numbers, tensors, batches, paths), not objects with state:
# a `call` that does not say what it changes is taken to change none of these inputs.
DATA_OPS = frozenset((
    "const", "fill", "randn", "copy", "add", "sub", "mul", "div", "ge", "gt", "le", "lt",
    "eq", "ne", "and", "or", "not", "read", "load", "data.load", "data.synthetic",
    "train.step", "evaluate", "dist.allreduce", "dist.broadcast", "model.gather", "export",
    "optimizer.rate",
))


def is_pure(call: ir.OpCall) -> bool:
    """Whether a `call` says `pure: true`: it changes none of its inputs and its results
    hold on to none of them."""
    return call.op == "call" and call.kwargs.get("pure") is True


def call_mutates(call: ir.OpCall) -> list[Any] | None:
    """The blob names a `call` says it changes (`mutates: [...]`), or None if it does not say."""
    listed = call.kwargs.get("mutates") if call.op == "call" else None
    return list(listed) if isinstance(listed, list) else None
