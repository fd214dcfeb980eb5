"""Static checks of what epoch tasks hand over, for `analyze` (and so for `train`).

- errors: `stop_when`, `early_stop` or `checkpoint.best` naming a blob that is no epoch
  task's output (the runner only sees outputs);
- warnings: `early_stop` or `checkpoint.best` watching an accuracy that is always null
  (evaluate's under `loss: mse`); the two watching one output in opposite modes; one
  output name in two epoch tasks: the run keeps both (per task), but each reader of
  outputs picks in its own way (runner/job.py, monitor.py, display.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from jobrun.errors import did_you_mean
from jobrun.plans import ir
from jobrun.plans.analyze_bodies import Problem
from jobrun.plans.visit import task_calls, written


def problems(plan: ir.Plan) -> Iterator[Problem]:
    """Watched names that are no outputs, then output names of two epoch tasks."""
    yield from _watched(plan)
    yield from _never_measured(plan)
    yield from _modes(plan)
    yield from _clashes(plan)


def _watched(plan: ir.Plan) -> Iterator[Problem]:
    """`stop_when`, `early_stop` and `checkpoint.best` name epoch-task outputs."""
    outputs = [o.name for t in plan.epoch.tasks for o in t.outputs]
    best = plan.checkpoint.best if plan.checkpoint is not None else None
    watched = [("stop-when", "stop_when names", ref) for ref in plan.stop_when] + [
        ("monitor", f"{what} monitors", watch.monitor.name)
        for what, watch in (("early_stop", plan.early_stop), ("checkpoint.best", best))
        if watch is not None
    ]
    for code, what, ref in watched:
        if ref.name not in outputs:
            makers = [t.name for t in plan.epoch.tasks if ref.name in written(t)]  # computed, not output
            yield (
                "error", code, ref.pos, f"{what} {ref.name!r}, which is not an output of any epoch task",
                f"add {ref.name!r} to the `outputs` of epoch task {makers[0]!r}, which computes it"
                if makers else did_you_mean(ref.name, outputs)
                or f"add {ref.name!r} to the `outputs` of the epoch task that computes it",
            )


def _never_measured(plan: ir.Plan) -> Iterator[Problem]:
    """A watched output that evaluate's accuracy under `loss: mse` gives: it is null in
    every epoch (the labels are no classes), and a null epoch is not counted, so
    early_stop never stops the job and checkpoint.best ranks no epoch."""
    best = plan.checkpoint.best if plan.checkpoint is not None else None
    for what, watch in (("early_stop", plan.early_stop), ("checkpoint.best", best)):
        if watch is None:
            continue
        name = watch.monitor.name
        task = next((t for t in plan.epoch.tasks if name.name in {o.name for o in t.outputs}), None)
        last = None if task is None else next(
            (c for c in reversed(list(task_calls(task))) if name.name in {o.name for o in c.outs}), None)
        if last is not None and last.op == "evaluate" and len(last.outs) > 1 and last.outs[1].name == name.name \
                and last.kwargs.get("loss") == "mse":
            yield ("warning", "monitor-null", name.pos,
                   f"{what} monitors {name.name!r}, the accuracy of an evaluate with loss: mse, which is null in "
                   "every epoch (the labels are no classes): a null epoch is not counted",
                   f"monitor its loss instead, `{last.outs[0].name}` (mode: min)")


def _modes(plan: ir.Plan) -> Iterator[Problem]:
    """`early_stop` and `checkpoint.best` on one output in opposite modes: one of them
    stops on (or keeps) the epochs the other takes as the worse (a `mode` left as it was
    when `monitor` changed)."""
    early, best = plan.early_stop, plan.checkpoint.best if plan.checkpoint is not None else None
    if early is None or best is None or early.monitor.name.name != best.monitor.name.name:
        return
    if early.monitor.mode != best.monitor.mode:
        name = early.monitor.name.name
        way = {"min": "a lower", "max": "a higher"}
        yield ("warning", "monitor-mode", early.pos or early.monitor.name.pos,
               f"early_stop takes {way[early.monitor.mode]} {name} as better (mode: {early.monitor.mode}), "
               f"checkpoint.best {way[best.monitor.mode]} one (mode: {best.monitor.mode})",
               "give both the same `mode`: min for a loss, max for an accuracy")


def _clashes(plan: ir.Plan) -> Iterator[Problem]:
    owners: dict[str, list[ir.Task]] = {}
    for task in plan.epoch.tasks:
        for out in task.outputs:
            owners.setdefault(out.name, []).append(task)
    for task in plan.epoch.tasks:
        for out in task.outputs:
            if owners[out.name][0] is not task:
                yield ("warning", "output-clash", out.pos, _clash(plan, out.name, task, owners[out.name]),
                       "rename one of them if they are two values (metrics.jsonl keeps each under "
                       "its task's name)")


def _clash(plan: ir.Plan, name: str, task: ir.Task, tasks: list[ir.Task]) -> str:
    """The warning at `task`'s output `name`, which `tasks` (all of them) give."""
    first = tasks[0]
    best = plan.checkpoint.best if plan.checkpoint is not None else None
    said = ["stop_when stops the job when any of them is truthy"] if name in {
        r.name for r in plan.stop_when} else []
    said += [f"{what} monitors the value of task {first.name!r} (the first)" for what, watch
             in (("early_stop", plan.early_stop), ("checkpoint.best", best))
             if watch is not None and watch.monitor.name.name == name]
    said.append("the epoch line shows each with its task's name ("  # runner/display.py
                + " ".join(f"{t.name}.{name}=..." for t in tasks) + ")")
    return (f"output {name!r} of task {task.name!r} is also an output of task {first.name!r} "
            f"(line {first.pos.line}): " + ", ".join(said))
