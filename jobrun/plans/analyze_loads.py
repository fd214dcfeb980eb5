"""Static checks of `checkpoint.load`, for `analyze` (and so for `train`).

It reads this run's checkpoints after training, so it is an error:

- in `init` or `epoch` (on a fresh run no checkpoint exists in init; in an epoch the
  weights would go back mid-training): it belongs in `download` or `exit`;
- in a plan without a `checkpoint` block (nothing is saved to load), or with `epoch: best`
  and no `checkpoint.best` (no epoch is ranked);
- for a blob the checkpoints do not hold (init rebuilds it and no step changes it, or
  `checkpoint.exclude` drops it), or for a literal value instead of a blob name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from jobrun.ops.spec import OpSpec
from jobrun.plans import ir
from jobrun.plans.analyze_bodies import Problem
from jobrun.plans.visit import task_calls, written

OP = "checkpoint.load"
_CODE = "checkpoint-load"


def problems(plan: ir.Plan, ops: Mapping[str, OpSpec]) -> Iterator[Problem]:
    """Every misplaced or unsatisfiable `checkpoint.load` of the plan."""
    held: dict[str, tuple[str, ...]] | None = None
    for group in plan.groups:
        for task in group.tasks:
            for call in task_calls(task):
                if call.op != OP:
                    continue
                if group.name in ("init", "epoch"):
                    yield ("error", _CODE, call.pos,
                           f"{OP} in `{group.name}`: it loads this run's checkpoints after training",
                           "move it to a task of `download` or `exit` (e.g. before an `evaluate` "
                           "of the test set)")
                    continue
                ckpt = plan.checkpoint
                if ckpt is None:
                    yield ("error", _CODE, call.pos, f"{OP}: this plan writes no checkpoints",
                           "add `checkpoint: {best: {monitor: val_loss, mode: min}}` (or `checkpoint: {}`)")
                    continue
                which = call.kwargs.get("epoch", "best")
                if isinstance(which, int) and plan.max_epochs is not None and which > plan.max_epochs:
                    yield ("error", _CODE, call.pos_of("epoch"),
                           f"{OP} loads epoch {which}, after the last (max_epochs: {plan.max_epochs})",
                           "give an epoch up to max_epochs, `last` or `best`")
                if which == "best" and ckpt.best is None:
                    yield ("error", _CODE, call.pos_of("epoch"),
                           f"{OP} loads the best epoch, but the plan has no `checkpoint.best` to rank epochs",
                           "add `best: {monitor: val_loss, mode: min}` to `checkpoint`, or give "
                           "`epoch: last` or an epoch's number")
                if held is None:
                    from jobrun.plans.state import checkpointed

                    held = checkpointed(plan, ops)
                made = set().union(*(written(t) for g in plan.groups for t in g.tasks if t.node == task.node))
                yield from _inputs(call, held.get(task.node, ()), ckpt, made)


def _inputs(call: ir.OpCall, held: tuple[str, ...], ckpt: ir.Checkpoint, made: set[str]) -> Iterator[Problem]:
    """(``made``: the names the node's steps write; one no step writes is the flow
    check's: read before it is defined, with its did-you-mean.)"""
    excluded = {ref.name for ref in ckpt.exclude}
    for item in call.ins:
        if not isinstance(item, ir.BlobRef):
            yield ("error", _CODE, call.pos, f"{OP} loads blobs by name; {item.value!r} is a value",
                   "give the names of the blobs to load: `in: [model]`")
        elif item.name in excluded:
            yield ("error", _CODE, item.pos, f"{OP}: blob {item.name!r} is not in the checkpoints: "
                   "`checkpoint.exclude` drops it", "remove it from `checkpoint.exclude`, or from this `in`")
        elif item.name not in held and item.name in made:
            yield ("error", _CODE, item.pos, f"{OP}: blob {item.name!r} is not in the checkpoints: "
                   "no step after init changes it, so every epoch's value is the one init built",
                   "load a blob that the epochs train (`jobrun print` shows what is checkpointed), "
                   "or add it to `checkpoint.include`")
