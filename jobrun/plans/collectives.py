"""Steps that talk to the other replicas while other such steps run: refused with replicas.

With replicas every rank must issue its collectives in the same order (jobrun.ops.dist).
Steps that run at the same time on one rank issue theirs in an order the threads decide,
which differs between ranks: the tasks of one group, the branches of a `parallel`, the
instances of a task; and a `report` runs when its clock says, so a different number of
times on each rank. Then gloo aborts the process (sizes that do not match), a rank waits
for ever, or, worst, one `evaluate`'s sums are added to another's and both report wrong
numbers. A plan on one replica runs them safely, so the check applies only with replicas.
"""

from __future__ import annotations

from collections.abc import Iterator

from jobrun.errors import PlanError, Pos
from jobrun.plans import ir
from jobrun.plans.visit import children, op_calls, task_calls

# The ops that issue collectives whenever the job has replicas: a model placed on the ranks
# (broadcast, then DDP's or FSDP's hooks), a step's backward, evaluate's sums, the dist ops.
# `build` and `call` issue them only for some code (a model built, a backward taken), which
# the plan does not say: they are not checked.
COLLECTIVE_OPS = frozenset((
    "model.mlp", "train.step", "evaluate", "dist.allreduce", "dist.broadcast", "model.gather",
    "checkpoint.load",
))

HINT = ("with replicas, every rank must run the steps that talk to the other replicas in one "
        "order: keep them in one task, outside `parallel` branches, `instances` and `report`s "
        "(run the other work at the same time, or the two evaluations one after the other)")


def problems(plan: ir.Plan) -> Iterator[tuple[Pos, str, str]]:
    """(position, message, hint) of each op that would issue collectives at the same time as
    another step does, or from a report, were the plan run with replicas."""
    for group in plan.groups:
        first: tuple[str, ir.OpCall] | None = None
        for task in group.tasks:
            call = _first(task_calls(task))
            if call is None:
                continue
            once = _first(op_calls(task.do))  # the instances run `do`; init and exit once
            if task.instances > 1 and once is not None:
                yield once.pos, (f"`{once.op}` talks to the other replicas, and the {task.instances} "
                                 f"instances of task {task.name!r} run it at once"), HINT
            if first is None:
                first = (task.name, call)
            else:
                yield call.pos, (f"`{call.op}` in task {task.name!r} talks to the other replicas while "
                                 f"`{first[1].op}` in task {first[0]!r} (line {first[1].pos.line}) of "
                                 f"the same group does, at the same time"), HINT
        for task in group.tasks:
            for block in children(task):
                yield from _block(block)


def _first(calls: Iterator[ir.OpCall]) -> ir.OpCall | None:
    return next((c for c in calls if c.op in COLLECTIVE_OPS), None)


def _block(steps: tuple[ir.Step, ...]) -> Iterator[tuple[Pos, str, str]]:
    for step in steps:
        if isinstance(step, ir.Report):
            call = _first(op_calls(step.body))
            if call is not None:
                yield call.pos, (f"`{call.op}` talks to the other replicas from a report, which runs "
                                 "when its clock says: a different number of times on each replica"), HINT
                continue
        if isinstance(step, ir.Parallel):
            first: tuple[int, ir.OpCall] | None = None
            for i, branch in enumerate(step.branches):
                call = _first(op_calls(branch.body))
                if call is None:
                    continue
                if first is None:
                    first = (i, call)
                else:
                    yield call.pos, (f"`{call.op}` talks to the other replicas in a branch of the "
                                     f"`parallel` at line {step.pos.line} while `{first[1].op}` "
                                     f"(line {first[1].pos.line}) does in another, at the same time"), HINT
        for block in children(step):
            yield from _block(block)


def refuse(plan: ir.Plan, replicas: int) -> None:
    """Refuse, before a run with `replicas` > 1 starts, the first such problem."""
    if replicas > 1:
        for pos, message, hint in problems(plan):
            raise PlanError(f"with {replicas} replicas, {message}", pos, hint)
