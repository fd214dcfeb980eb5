"""One visitor mechanism shared by the analyzer, the printer and the executor's compiler.

`visit(node)` dispatches to `visit_<ClassName>`; `generic_visit` walks the steps a node
holds. Subclasses override what they care about and call `generic_visit` for the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jobrun.plans import ir


def children(node: Any) -> tuple[tuple[ir.Step, ...], ...]:
    """The blocks of steps directly inside a node, in source order."""
    if isinstance(node, ir.Loop | ir.Report | ir.IfBranch | ir.Branch):
        return (node.body,)
    if isinstance(node, ir.If):
        blocks = tuple(b.body for b in node.branches)
        return blocks + ((node.orelse,) if node.orelse is not None else ())
    if isinstance(node, ir.Parallel):
        return tuple(b.body for b in node.branches)
    if isinstance(node, ir.Task):
        return (node.init, node.do, node.exit)
    return ()


def op_calls(steps: tuple[ir.Step, ...]) -> Iterator[ir.OpCall]:
    """Every op call of a block, nested blocks included, in source order."""
    for step in steps:
        if isinstance(step, ir.OpCall):
            yield step
        for block in children(step):
            yield from op_calls(block)


def task_calls(task: ir.Task) -> Iterator[ir.OpCall]:
    """Every op call of a task (its init, do and exit blocks), in source order."""
    for block in children(task):
        yield from op_calls(block)


def also_written(call: ir.OpCall) -> tuple[ir.BlobRef, ...]:
    """What an op writes besides its outs: train.step's `<loss>_last`, the last step's
    loss (after a loop, the loss itself holds the mean over the loop's steps)."""
    if call.op == "train.step" and call.outs:
        return (ir.BlobRef(call.outs[0].name + "_last", call.outs[0].pos),)
    return ()


def written(node: Any) -> set[str]:
    """The blobs the ops in a node (a task, a step) write, at any depth."""
    out = {o.name for o in (*node.outs, *also_written(node))} if isinstance(node, ir.OpCall) else set()
    for block in children(node):
        for step in block:
            out |= written(step)
    return out


class Visitor:
    def visit(self, node: Any) -> Any:
        method = getattr(self, "visit_" + type(node).__name__, None)
        return method(node) if method is not None else self.generic_visit(node)

    def visit_block(self, steps: tuple[ir.Step, ...]) -> None:
        for step in steps:
            self.visit(step)

    def generic_visit(self, node: Any) -> Any:
        if isinstance(node, ir.Plan):
            for group in node.groups:
                self.visit(group)
        elif isinstance(node, ir.Group):
            for task in node.tasks:
                self.visit(task)
        else:
            for block in children(node):
                self.visit_block(block)
        return None
