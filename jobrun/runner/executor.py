"""Executes tasks: each task compiled into generated Python functions over workspaces.

A task is compiled once per node, bound to that node's global workspace ``G`` (a dict
living the whole job) and to the task's own workspace ``T`` (cleared when the task
ends). A private task's ``T`` reads through to ``G``; a write to a name that exists in
``G`` updates it, and new names stay in ``T``. A global task's ``T`` is ``G``. Each
generated function runs in a workspace ``L`` it is given: ``T``, or with `instances: N`
each instance's own child workspace for `do`, which reads through to ``T`` (and so to
``G``); a write to a name that exists there updates it, new names stay in the instance.

The code generator (:mod:`jobrun.runner.codegen_task`) writes each section of the task
as one Python function; `CompiledTask.run` runs them, a task's instances concurrently
(:mod:`jobrun.runner.concurrency`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from jobrun.errors import RunError
from jobrun.ops.context import OpContext
from jobrun.plans import ir
from jobrun.runner import clock
from jobrun.runner.codegen_task import Generator
from jobrun.runner.concurrency import run_concurrently

if TYPE_CHECKING:
    from jobrun.runner.profile import Profile


@dataclasses.dataclass
class NodeRuntime:
    """One node (on this rank): its global workspace and its op context."""

    name: str
    ctx: OpContext
    globals: dict[str, Any] = dataclasses.field(default_factory=dict)
    task_ctxs: list[OpContext] = dataclasses.field(default_factory=list)


class CompiledTask:
    """A task generated once for its node; `run` runs it (every epoch, for an epoch task)."""

    def __init__(self, task: ir.Task, node: NodeRuntime, profile: Profile | None = None,
                 max_steps: int | None = None, shared: frozenset[str] | None = None):
        self.task = task
        self.node = node
        self.ctx = dataclasses.replace(node.ctx, task=task.name)
        node.task_ctxs.append(self.ctx)
        g = node.globals
        self.local: dict[str, Any] = g if task.workspace == "global" else _private_workspace(g)
        # `max_steps` ends the loops of epoch tasks (the epoch) once the global step reaches it.
        limit = max_steps if task.group == "epoch" else None
        generator = Generator(self.ctx, g, self.local, task, node.name, profile, limit, shared)
        self._init, self._do, self._exit = generator.visit(task)

    def run(self) -> dict[str, Any]:
        """Run init, do (all instances, each in its own workspace), exit; return the
        declared outputs."""
        local = self.local
        counting = clock.counting(self.ctx._counters)  # optimizer steps count on this node
        try:
            self._init(local)
            if self.task.instances == 1:
                self._do(local)
            else:
                run_concurrently([functools.partial(self._do, _child_workspace(local))
                                  for _ in range(self.task.instances)], f"task {self.task.name!r}")
            self._exit(local)
            return {ref.name: self._output(ref) for ref in self.task.outputs}
        finally:
            clock.stop_counting(counting)
            if self.local is not self.node.globals:
                self.local.clear()

    def _output(self, ref: ir.BlobRef) -> Any:
        try:
            return self.local[ref.name]
        except KeyError:
            raise RunError(
                f"task {self.task.name!r} on node {self.node.name!r} ended without defining its output {ref.name!r}",
                ref.pos,
                "define it in the task's steps, or remove it from `outputs`",
            ) from None


def _private_workspace(g: dict[str, Any]) -> dict[str, Any]:
    """A private task's own workspace: a dict whose missing names are read from `g`.

    Its ``__missing__`` is `g`'s own ``__getitem__`` (a C function, hence a class per
    workspace), so that ``L[name]`` reads a global blob (model, optimizer, reader: most
    reads of a training loop) without running Python code; a name in neither raises
    KeyError(name).
    """

    class PrivateWorkspace(dict):
        __slots__ = ()
        __missing__ = staticmethod(g.__getitem__)

    return PrivateWorkspace()


# An instance's workspace reads through to its task's the same way.
_child_workspace = _private_workspace
