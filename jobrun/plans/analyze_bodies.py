"""Static checks of the shape of a plan's bodies, for `analyze` (and so for `train`).

- warnings: a `do:` with no steps (`do: []`, or `do:` left empty) in a loop, a parallel
  branch or a report, and a task with no steps at all: the plan compiles, but the body
  does nothing, which is most often a slip (steps deleted, or left out by an indentation).
- errors: a `loop: null` with no `stop_if` in its body (outside the loops nested in it and
  its reports), unless it is in an epoch task of a plan with `max_steps` (which ends the
  loops of epoch tasks): only a stop_if ends such a loop, so it never ends and the run hangs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.visit import children

Problem = tuple[str, str, Pos, str, str | None]  # severity, code, pos, message, hint

_EMPTY_HINT = "list its steps under `do:` (indented, each starting with `- `), or remove it"


def problems(plan: ir.Plan) -> Iterator[Problem]:
    """Empty bodies and loops that never end, in every task of the plan."""
    for group in plan.groups:
        for task in group.tasks:
            if not (task.init or task.do or task.exit):
                yield ("warning", "empty-body", task.pos,
                       f"task {task.name!r} of group `{group.name}` has no steps: it does nothing",
                       _EMPTY_HINT)
            for block in children(task):  # max_steps ends the loops of epoch tasks only
                yield from _block(block, plan.max_steps is not None and group.name == "epoch")


def _block(steps: tuple[ir.Step, ...], max_steps: bool) -> Iterator[Problem]:
    """`max_steps`: whether max_steps ends these steps' loops that take optimizer steps."""
    for step in steps:
        if (isinstance(step, ir.Loop) and step.count is None and not stops(step.body)
                and not (max_steps and _may_step(step.body))):
            yield ("error", "endless-loop", step.pos,
                   "this `loop: null` never ends: no `stop_if` in its body leaves it",
                   "add `- stop_if: BLOB` to the loop's `do` (e.g. a read's `done`), or give "
                   "the loop a count: `loop: 10`")
        elif isinstance(step, ir.Loop | ir.Report) and not step.body:
            what = "loop" if isinstance(step, ir.Loop) else "report"
            yield ("warning", "empty-body", step.pos, f"this {what} has no steps in its `do`", _EMPTY_HINT)
        elif isinstance(step, ir.Parallel):
            for i, branch in enumerate(step.branches):
                if not branch.body:
                    label = repr(branch.name) if branch.name else f"#{i + 1}"
                    yield ("warning", "empty-body", branch.pos,
                           f"branch {label} of this `parallel` has no steps in its `do`", _EMPTY_HINT)
        for block in children(step):
            yield from _block(block, max_steps)


def stops(steps: tuple[ir.Step, ...]) -> bool:
    """Whether a stop_if in `steps` can leave the loop they are the body of (a stop_if in
    a nested loop leaves that loop; one in a report ends the report's body)."""
    for step in steps:
        if isinstance(step, ir.StopIf):
            return True
        if isinstance(step, ir.If | ir.Parallel) and any(stops(b) for b in children(step)):
            return True
    return False


# Ops that may take an optimizer step: max_steps ends a loop only through them (the global
# step is counted as optimizers step). An op of a plug-in may too.
_STEPPING = frozenset({"train.step", "call"})


@functools.cache
def _jobruns_ops() -> frozenset[str]:
    from jobrun.ops.registry import CORE_SPECS
    from jobrun.ops.train_specs import TRAIN_SPECS

    return frozenset(spec.name for spec in (*CORE_SPECS, *TRAIN_SPECS))


def _may_step(steps: tuple[ir.Step, ...]) -> bool:
    """Whether an optimizer step can happen in `steps` (a report's body is not counted:
    it runs beside the loop, not in its iterations)."""
    core = _jobruns_ops()
    for step in steps:
        if isinstance(step, ir.OpCall) and (step.op in _STEPPING or step.op not in core):
            return True
        if not isinstance(step, ir.Report) and any(_may_step(b) for b in children(step)):
            return True
    return False
