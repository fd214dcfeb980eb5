"""`instances: N` that train one shared model: refused by `analyze` (and so by `train`).

The N instances of a task run its `do` at once, in threads, each in a workspace of its
own over the shared ones. A training op (`train.step`, `backward`, an optimizer step...)
that changes a model or optimizer the instances share runs N times at once on the same
parameters: autograd fails ("one of the variables needed for gradient computation has
been modified by an inplace operation") or, worse, updates race. An instance's own
model (built in its `do`) is fine; so is reading one shared reader (its reads are locked).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from jobrun.errors import Pos
from jobrun.ops.spec import OpSpec
from jobrun.plans import ir
from jobrun.plans.visit import op_calls


def problems(plan: ir.Plan, ops: Mapping[str, OpSpec]) -> Iterator[tuple[Pos, str, str]]:
    """(position, message, hint) of each training op whose changed input the instances share."""
    for group in plan.groups:
        for task in group.tasks:
            if task.instances > 1:
                yield from _task(task, ops)


def _task(task: ir.Task, ops: Mapping[str, OpSpec]) -> Iterator[tuple[Pos, str, str]]:
    own: set[str] = set()  # names the instance defines before it trains them: its own
    for call in op_calls(task.do):
        spec = ops.get(call.op)
        if spec is not None and spec.category == "training" and spec.mutates:
            shared = [ref.name for ref, name in zip(call.ins, spec.input_names(len(call.ins)))
                      if isinstance(ref, ir.BlobRef) and name in spec.mutates and ref.name not in own]
            if shared:
                names = " and ".join(map(repr, shared))
                yield call.pos, (
                    f"the {task.instances} instances of task {task.name!r} all change {names} with "
                    f"`{call.op}` at once, and they share {'them' if len(shared) > 1 else 'it'}: "
                    "training one model in several threads fails in autograd (or loses updates)"), (
                    "train a shared model in one task (instances: 1; `replicas: N` trains it data-"
                    "parallel), or give each instance its own model, built in the task's `do`")
        own.update(out.name for out in call.outs)

