"""Static checks of how a plan gets its data, for `analyze` (and so for `train`).

Two kinds, both worked out from the plan alone (no file is opened, no torch):

- errors: a `data.load` whose arguments cannot fit its file's type, which the literal
  `path` tells (a raw `.bin` without `dtype`, `dtype` on anything else, `columns` on a
  file that is not `.csv`, `mmap` on one that cannot be mapped, an unknown suffix). The
  op itself refuses the same through :func:`load_problem`: one rule, two places to meet it.
- warnings: a reader made once, in `init`, with a finite number of `passes`, that every
  epoch reads to the end of a pass (an unbounded loop that stops at the read's `done`):
  the epochs after the last pass read nothing and train on nothing; `shuffle` or
  `drop_last` beside `sample: random`, which ignores them.

It also tells the analyzer which `stop_if`s cannot end their loop's first iteration
(:func:`first_batch_stop`): what a loop defines after one of those is defined after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import PurePath
from typing import Any

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.analyze_bodies import stops
from jobrun.plans.visit import children, op_calls, task_calls

# The suffixes `data.load` reads (jobrun/ops/data.py), and those it can memory-map.
LOAD_SUFFIXES = (".npz", ".npy", ".bin", ".csv", ".safetensors", ".pt")
MAPPED_SUFFIXES = (".bin", ".npy")

Problem = tuple[str, str, Pos, str, str | None]  # severity, code, pos, message, hint


def load_problem(path: str, dtype: Any, columns: Any, mmap: Any) -> tuple[str, str | None, str] | None:
    """What is wrong with `data.load` arguments for the file ``path`` names: (message,
    hint, the argument to point at), or None when they fit its suffix."""
    name = PurePath(path).name
    suffix = PurePath(path).suffix.lower()
    if suffix not in LOAD_SUFFIXES:
        return (f"data.load: unsupported file type {suffix or '(none)'!r} for {name!r}",
                "supported: .npz, .npy, .bin (raw, with a dtype), .csv, .safetensors, .pt", "path")
    if suffix != ".csv" and columns is not None:
        return "data.load: `columns` applies to .csv files only", "remove `columns`", "columns"
    if (dtype is None) == (suffix == ".bin"):
        from jobrun.ops.train_specs import RAW_DTYPES

        hint = f"dtype is one of {', '.join(RAW_DTYPES)}"
        if dtype is None:
            return (f"data.load: a .bin file is raw and needs its `dtype`, e.g. dtype: uint16 ({name!r})",
                    hint, "path")
        return "data.load: `dtype` applies to raw .bin files only", hint, "dtype"
    if mmap and suffix not in MAPPED_SUFFIXES:
        return (f"data.load: only .bin and .npy files can be memory-mapped, not {suffix!r}",
                "remove `mmap: true`", "mmap")
    return None


def problems(plan: ir.Plan) -> list[Problem]:
    """Every data problem of ``plan``, in plan order."""
    return [*_load_problems(plan), *_random_windows(plan), *_drained_readers(plan), *_read_outputs(plan)]


def _random_windows(plan: ir.Plan) -> Iterator[Problem]:
    """`sample: random` draws every batch's windows anew: `shuffle` and `drop_last` given
    beside it do nothing (a run with them read the same batches as one without)."""
    for call in _calls(plan.groups):
        if call.op == "reader" and call.kwargs.get("window") is not None and call.kwargs.get("sample") == "random":
            for key in ("shuffle", "drop_last"):
                if call.kwargs.get(key):
                    yield ("warning", "reader-random", call.pos_of(key),
                           f"reader: `{key}` does nothing with `sample: random` (each batch's windows "
                           "are drawn anew, anywhere in the stream)", f"remove `{key}`, or use `sample: order`")


def _load_problems(plan: ir.Plan) -> Iterator[Problem]:
    for call in _calls(plan.groups):
        if call.op != "data.load":
            continue
        args = call.kwargs
        path = args.get("path")
        if not isinstance(path, str):
            continue  # a missing or mistyped path is the signature check's
        found = load_problem(path, args.get("dtype"), args.get("columns"), args.get("mmap"))
        if found is not None:
            message, hint, key = found
            yield "error", "data-load", call.pos_of(key), message, hint


def _read_outputs(plan: ir.Plan) -> Iterator[Problem]:
    """A `read` with more outputs than its reader gives (its fields, then `done`), which
    failed at run time, after the run directory was made. Counted where a reader's fields
    are its blob inputs (two or more, no `window` or `keys`; a Dataset's are known only
    once read); a blob made a reader twice with different counts is not checked. So is one
    whose last output, tested by a `stop_if` as `done`, gets the reader's last field."""
    fields: dict[tuple[str, str], int | None] = {}
    for task in plan.tasks():
        for call in task_calls(task):
            if call.op == "reader" and call.outs:
                plain = (len(call.ins) >= 2 and all(isinstance(i, ir.BlobRef) for i in call.ins)
                         and call.kwargs.get("window") is None and call.kwargs.get("keys") is None)
                key, n = (task.node, call.outs[0].name), len(call.ins) if plain else None
                fields[key] = n if fields.get(key, n) == n else None
    for task in plan.tasks():
        tested = {id(r) for block in children(task) for r in done_reads(block)}
        for call in task_calls(task):
            if call.op != "read" or not call.ins or not isinstance(call.ins[0], ir.BlobRef):
                continue
            n = fields.get((task.node, call.ins[0].name))
            if n is not None and len(call.outs) == n and id(call) in tested:
                last = call.outs[-1].name
                yield ("error", "read-outputs", call.outs[-1].pos,
                       f"read: reader {call.ins[0].name!r} gives {n} fields and then `done`, and `out` names "
                       f"{n - 1} before {last!r}: {last!r} gets field {n}, though a `stop_if` tests it as `done`",
                       f"name {n} fields, then `done`")
            if n is not None and len(call.outs) > n + 1:
                yield ("error", "read-outputs", call.outs[n + 1].pos,
                       f"read: reader {call.ins[0].name!r} gives {n} fields and then `done`, so `out` "
                       f"takes at most {n + 1} names, got {len(call.outs)}",
                       f"remove {', '.join(repr(o.name) for o in call.outs[n + 1:])} from `out`")


# -- readers that run out --------------------------------------------------------------


def _drained_readers(plan: ir.Plan) -> Iterator[Problem]:
    """Readers made in `init` with passes: N that every epoch reads to a pass's end."""
    made_in_epoch = {(t.node, ref.name) for t in plan.epoch.tasks for call in task_calls(t) for ref in call.outs}
    readers: dict[tuple[str, str], ir.OpCall] = {}
    for task in plan.init.tasks:
        for call in task_calls(task):
            passes = call.kwargs.get("passes", 1)
            endless = call.kwargs.get("window") is not None and call.kwargs.get("sample") == "random"
            if call.op == "reader" and call.outs and isinstance(passes, int) and passes >= 1 and not endless:
                key = (task.node, call.outs[0].name)
                if key not in made_in_epoch:
                    readers[key] = call
    warned: set[tuple[str, str]] = set()
    stops = {ref.name for ref in plan.stop_when}  # `stop_when: [end]`: the job ends with the pass
    for task in plan.epoch.tasks:
        for read in (r for block in children(task) for r in done_reads(block, unbounded=True)):
            key = (task.node, read.ins[0].name)  # type: ignore[union-attr]
            made = readers.get(key)
            if made is None or key in warned or read.outs[-1].name in stops:
                continue
            passes = made.kwargs.get("passes", 1)
            if plan.max_epochs is not None and plan.max_epochs <= passes:
                continue  # every epoch has a pass of its own
            warned.add(key)
            yield _drained(made, read, passes)


def _drained(made: ir.OpCall, read: ir.OpCall, passes: int) -> Problem:
    name = made.outs[0].name
    given = "passes" in made.kwargs
    first = "the first epoch gets" if passes == 1 else f"the first {passes} epochs get"
    message = (f"reader {name!r} is made once, in init, with passes: {passes}"
               f"{'' if given else ' (the default)'}, and every epoch reads it to the end of a "
               f"pass (line {read.pos.line}): only {first} batches, the later ones train on nothing")
    hint = ("give it `passes: 0` (it reads on, pass after pass; `stop_if` on the read's `done` "
            "still ends each epoch at a pass's end), or make the reader in the epoch group")
    return "warning", "reader-passes", made.pos_of("passes") if given else made.pos, message, hint


def done_reads(steps: tuple[ir.Step, ...], *, unbounded: bool = False) -> Iterator[ir.OpCall]:
    """The `read`s in loops of `steps` whose last output a `stop_if` of the loop tests: that
    output is meant as the read's `done`, whatever its reader gives. With `unbounded`, only
    those of loops without a count, each run of which reads to the end of a pass."""
    for step in steps:
        if isinstance(step, ir.Loop) and (step.count is None or not unbounded):
            tested = _stop_names(step.body)
            for call in op_calls(step.body):
                if (call.op == "read" and len(call.outs) >= 2 and call.outs[-1].name in tested
                        and call.ins and isinstance(call.ins[0], ir.BlobRef)):
                    yield call
        for block in children(step):
            yield from done_reads(block, unbounded=unbounded)


def _stop_names(steps: tuple[ir.Step, ...]) -> set[str]:
    """The blobs `stop_if` steps of this loop body test (inner loops stop only themselves)."""
    names: set[str] = set()
    for step in steps:
        if isinstance(step, ir.StopIf):
            names.add(step.cond.name)
        elif isinstance(step, ir.If):
            for block in children(step):
                names |= _stop_names(block)
    return names


# -- loops that read a pass to its end -----------------------------------------------


def pass_readers(plan: ir.Plan) -> set[tuple[str, str]]:
    """(node, blob) of the readers whose every `read` starts a pass or goes on in one, never
    meets a pass's end left pending: made only by `reader` with `passes: 0`, and read by one
    `read` alone (no `every`, in a task of one instance, not where `max_steps` can end its
    loop after a pass's last batch). An `evaluate` of a whole pass leaves the position alone;
    any other use of the blob may move it."""
    makers: dict[tuple[str, str], set[bool]] = {}
    uses: dict[tuple[str, str], list[bool]] = {}
    for group in plan.groups:
        cut = plan.max_steps is not None and group.name == "epoch"  # max_steps ends its loops
        for task in group.tasks:
            for call in task_calls(task):
                for out in call.outs:
                    passes = call.kwargs.get("passes") if call.op == "reader" else None
                    makers.setdefault((task.node, out.name), set()).add(type(passes) is int and passes == 0)
                if call.op == "evaluate" and call.kwargs.get("batches") is None:
                    continue
                lone = call.op == "read" and call.every is None and task.instances == 1 and not cut
                for ref in call.ins:
                    if isinstance(ref, ir.BlobRef):
                        uses.setdefault((task.node, ref.name), []).append(lone)
    return {key for key, made in makers.items() if made == {True} and uses.get(key) == [True]}


def first_batch_stop(loop: ir.Loop, node: str, readers: set[tuple[str, str]]) -> ir.StopIf | None:
    """The `stop_if` of a `loop: null` that cannot end its first iteration, if any: the
    only one that leaves the loop, at the top of its body, right after a `read` of one of
    `readers` (:func:`pass_readers`), testing its `done`. Each run of the loop then starts
    at a pass's first batch, and a pass always has one (jobrun/ops/reader.py refuses a
    reader whose pass has none), so the first `done` comes after a batch."""
    tops = [i for i, step in enumerate(loop.body) if isinstance(step, ir.StopIf)]
    if loop.count is not None or len(tops) != 1 or not tops[0] or stops(
        tuple(step for step in loop.body if not isinstance(step, ir.StopIf))  # one in an if or a branch
    ):
        return None  # a count, or another stop_if, can end the loop before a pass's end
    read, stop = loop.body[tops[0] - 1], loop.body[tops[0]]
    assert isinstance(stop, ir.StopIf)
    if (isinstance(read, ir.OpCall) and read.op == "read" and len(read.outs) >= 2 and stop.every is None
            and read.outs[-1].name == stop.cond.name and isinstance(read.ins[0], ir.BlobRef)
            and (node, read.ins[0].name) in readers):
        return stop
    return None


def _calls(groups: tuple[ir.Group, ...]) -> Iterator[ir.OpCall]:
    for group in groups:
        for task in group.tasks:
            yield from task_calls(task)
