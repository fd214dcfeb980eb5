"""The files and the code a plan reads, checked before a run starts (`train`, `resume`).

`data.load` and `load` read a file named by a literal `path` (vars already applied).
One that does not exist would fail only after torch is imported and the run directory
is made; `train` refuses it at once instead, with the plan's file:line and where a
relative path is looked for. A file the plan may make itself is not checked: one that
another step names among its arguments (a `save` or `export` writes it, a `call` is
given it), and any file read after user code that may write it (a `call`, an op of a
plugin, running earlier or at the same time). Nothing here imports torch.

The code a plan names (`build`'s and nested `target`s, `call`'s `fn`, the optimizer's
`class`, a loss or `collate_fn` given by import path) is imported by
:func:`check_code` once torch is, still before the run directory is made: a module that
is not found, a misspelt name, or a keyword argument the code's signature does not have is
refused at its argument's file:line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobrun.errors import PlanError, Pos, RunError
from jobrun.plans import ir
from jobrun.plans.visit import also_written, task_calls

READERS = frozenset({"data.load", "load"})  # ops whose `path` is a file read from the plan's directory
WRITERS = frozenset({"save", "export"})  # ops whose `path` is a file written in the run directory


def check(plan: ir.Plan, plan_dir: Path, run_dir: Path) -> None:
    """Refuse a tracker of `loggers` whose package is not installed, and the first file a
    reader of ``plan`` names that does not exist."""
    _check_trackers(plan)
    from jobrun.ops.context import under
    from jobrun.ops.registry import CORE_SPECS
    from jobrun.ops.train_specs import TRAIN_SPECS

    builtin = {spec.name for spec in (*CORE_SPECS, *TRAIN_SPECS)} - {"call"}
    order = list(_ordered(plan))
    made: set[str] = set()  # what the plan's other steps name: they may write it
    for _slot, step in order:
        if step.op not in READERS:
            for text in _strings([value for _key, value in step.args]):
                made |= {text, str(under(plan_dir, text)), str(under(run_dir, text)), os.path.abspath(text)}
    user_code = [slot for slot, step in order if step.op not in builtin]
    _check_writes(plan, order, run_dir)
    for slot, step in order:
        path = dict(step.args).get("path")
        if step.op not in READERS or not isinstance(path, str):
            continue
        file = under(plan_dir, path)
        if path in made or str(file) in made or any(_before(u, slot) for u in user_code) or file.is_file():
            continue
        pos = dict(step.arg_pos).get("path", step.pos)
        what = "is a directory, not a file" if file.is_dir() else "does not exist"
        hint = (f"relative paths are read from the plan file's directory ({plan_dir}), not from "
                "the current directory")
        if not Path(path).is_absolute() and Path(path).expanduser().is_file():
            hint += f"; {path} is in the current directory: give its path from the plan's directory"
        raise PlanError(f"{step.op}: {path!r} {what} ({file})" if str(file) != path else
                        f"{step.op}: {path!r} {what}", pos, hint)


def _check_writes(plan: ir.Plan, order: list[tuple[Any, ir.OpCall]], run_dir: Path) -> None:
    """Refuse a `save` of a file type it cannot write, and a `save` or `export` whose
    `path` is a file of the run's own (run.json, a checkpoint): written, it left every
    command unable to read the run."""
    from jobrun.ops.context import under
    from jobrun.ops.core import save_type_problem
    from jobrun.runner.rundir import RunDir, jobruns_own

    checkpoints = RunDir(run_dir, plan).checkpoints
    for _slot, step in order:
        path = dict(step.args).get("path")
        if step.op in WRITERS and isinstance(path, str):
            where = dict(step.arg_pos).get("path", step.pos)
            owned = jobruns_own(run_dir, checkpoints, under(run_dir, path))
            if owned is not None:
                raise PlanError(f"{step.op}: path {path!r} {owned}: writing it would leave the run "
                                "unreadable", where,
                                "give the file a name of its own (e.g. model.safetensors)")
            problem = save_type_problem(path) if step.op == "save" else None
            if problem is not None:  # found after training, once
                raise PlanError(problem[0], where, problem[1])


def _ordered(plan: ir.Plan) -> Iterator[tuple[tuple[int, int, int], ir.OpCall]]:
    """Every op call with its slot: (group number, task number, number in the task)."""
    for g, group in enumerate(plan.groups):
        for t, task in enumerate(group.tasks):
            for k, step in enumerate(task_calls(task)):
                yield (g, t, k), step


def _before(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    """Whether the step in slot ``a`` may run before the one in slot ``b``: an earlier
    group, another task of the same group (tasks of a group run at once), or an earlier
    step of the same task."""
    return a[0] < b[0] or (a[0] == b[0] and (a[1] != b[1] or a[2] < b[2]))


def _strings(values: Any) -> Iterator[str]:
    if isinstance(values, str):
        yield values
    elif isinstance(values, dict):
        for v in values.values():
            yield from _strings(v)
    elif isinstance(values, list | tuple):
        for v in values:
            yield from _strings(v)


# The arguments that name code by import path, per op; `build`, `optimizer` and `scheduler`
# also take nested `{target: ...}` mappings anywhere in their arguments (ops/models.py).
CODE_ARGS = {"call": ("fn",), "build": ("target",), "optimizer": ("target",), "scheduler": ("target",),
             "reader": ("collate_fn",), "train.step": ("loss",), "evaluate": ("loss",)}
NESTING = frozenset({"build", "optimizer", "scheduler"})


def _check_trackers(plan: ir.Plan) -> None:
    """A tracker package not installed (not imported: that takes seconds) is refused here,
    before the run directory is made; found at the run's start, it left a run that had
    "died"."""
    import importlib.util

    for name in plan.loggers:
        if name != "csv" and importlib.util.find_spec(name) is None:
            raise PlanError(f"`loggers: [{name}]` needs the {name} package, which is not installed",
                            plan.loggers_pos or plan.pos,
                            f'install the extra: pip install "jobrun[{name}]", or remove {name} from `loggers`')


def check_code(plan: ir.Plan, plan_dir: Path) -> None:
    """Import what ``plan`` names as code, as the ops will (the plan's directory first on
    the import path, as in a worker), and refuse the first name that is not found. A
    module that raises while it is imported is left to the run, which shows the user's
    traceback under the op. Imports the user's modules, and so torch: `train` and
    `resume` only, after their torch-free checks."""
    from jobrun.ops.imports import resolve
    from jobrun.ops.optim import optimizer_class

    if str(plan_dir) not in sys.path:
        sys.path.insert(0, str(plan_dir))
    schedulers = _schedulers(plan)
    for (g, t, _k), step in _ordered(plan):
        for where, key, path in _named_code(step):
            try:
                if step.op == "optimizer" and key in ("class", "target"):
                    path = optimizer_class(step.kwargs.get("class"), step.kwargs.get("target"))
                resolve(path, step.op, key)
            except RunError as e:
                _refuse_if_missing(e, step.pos_of(where))
        if step.op in ("optimizer", "scheduler"):
            _check_constructor_args(step)
        _check_target_keys(step)
        _check_binds(step)
        if step.op == "scheduler.step" and isinstance(step.ins[0], ir.BlobRef):
            made = schedulers.get((plan.groups[g].tasks[t].node, step.ins[0].name), {None})
            if len(made) == 1 and None not in made:
                _check_metric(step, *made)
    for path in plan.fsdp_layers if plan.parallel == "fsdp" else ():  # a typo failed on every rank
        try:
            resolve(path, "fsdp_layers", "class")
        except RunError as e:
            _refuse_if_missing(e, plan.fsdp_layers_pos or plan.pos)


def _refuse_if_missing(e: RunError, pos: Pos) -> None:
    """Refuse at ``pos`` code that is not there, misspelt or not Python (``e``: resolve's
    RunError; a syntax error's file:line is all there is to show); a module that raised
    while it was imported is left to the run, which shows its traceback under the op."""
    if e.__cause__ is None or isinstance(e.__cause__, ModuleNotFoundError | SyntaxError):
        raise PlanError(e.message, pos, e.hint) from None


def _check_constructor_args(step: ir.OpCall) -> None:
    """An optimizer's, or a torch scheduler's (`scheduler` with a `target`), own keys
    against its constructor: one it does not take failed in init (`momentum` left when
    `class` became Adam, StepLR's `step_sise`), and a flag given as anything but a bool
    was taken as true (`nesterov: "false"` turned Nesterov on)."""
    from jobrun.ops.optim import named_optimizer, optimizer_class, option_fault
    from jobrun.ops.schedule import SCHEDULE_ARGS

    if step.op == "optimizer":
        path, first, own = optimizer_class(step.kwargs.get("class"), step.kwargs.get("target")), "params", ("groups",)
    elif isinstance(step.kwargs.get("target"), str):
        path, first, own = step.kwargs["target"], "optimizer", SCHEDULE_ARGS  # those are refused beside it
    else:
        return  # jobrun's own schedule: its arguments are checked with the op's
    found = _keywords(path, step.op, first)
    if found is None:
        return
    name, params = found
    for key, value in step.args:
        if key in ("class", "target", *own):
            continue
        if step.op == "optimizer" and key not in params and (named := named_optimizer(value)):
            # `kind: adam`, `type: AdamW`: the class asked for, by another key
            raise PlanError(f"{step.op}: {name} takes no argument {key!r}", step.key_of(key),
                            f"to train with torch.optim.{named}, write `class: {named}` instead of `{key}`")
        _known(step, name, params, key, step.key_of(key))
        fault = option_fault(step.op, key, value, params[key])
        if fault is not None:
            raise PlanError(fault.message, step.pos_of(key), fault.hint)
    if step.op == "optimizer" and "groups" in step.kwargs:
        _check_groups(step, path)


def _check_groups(step: ir.OpCall, path: str) -> None:
    """`groups`' rules as the run checks them, short of the model: a rule's misspelt
    option (`learning_rate`) failed in init, after the run directory was made."""
    from jobrun.ops.imports import resolve
    from jobrun.ops.optim import group_options, rules_fault

    try:
        cls = resolve(path, step.op, "class")
    except RunError:
        return  # refused by check_code, or left to the run
    groups = step.kwargs["groups"]
    fault = rules_fault(groups, group_options(cls), getattr(cls, "__name__", path))
    if fault is None:
        return
    i, key, error = fault
    rule = groups[i] if i is not None else None
    pos = step.pos_of("groups")
    if i is not None and hasattr(groups, "at"):
        pos = groups.at(i)
    if key is not None and hasattr(rule, "key_at"):
        pos = rule.key_at(key)
    raise PlanError(error.message, pos, error.hint)


# The keys of an op that are its own, not keyword arguments of the code it calls.
OWN_KEYS = {"build": ("target", "args", "fork_rng", "compile"), "call": ("fn", "mutates", "pure")}


def _check_target_keys(step: ir.OpCall) -> None:
    """The keyword arguments a plan gives to user code against its signature: `build`'s
    `target`, `call`'s `fn`, and the nested `{target: ...}` mappings of `build`,
    `optimizer` and `scheduler`. A misspelt one (`hiden: 64`) failed when the run called
    it, in init, after the run directory was made."""
    own = OWN_KEYS.get(step.op)
    if own is not None and isinstance(step.kwargs.get(own[0]), str):
        found = _keywords(step.kwargs[own[0]], step.op, None)
        for key, _ in step.args if found is not None else ():
            if key not in own:
                _known(step, *found, key, step.key_of(key), own)
    if step.op in NESTING:
        for arg, value in step.args:
            for target, keys, _positional, _pos in _nested(value):
                found = _keywords(target, step.op, None)
                for key in keys if found is not None else ():
                    _known(step, *found, key, step.pos_of(arg), ("target", "args", "in"))


def _check_binds(step: ir.OpCall) -> None:
    """The code a `call` or a `build` calls against what the step gives it. A `call`'s
    function gets the inputs by position, the other keys by name and the context it asks
    for; `build`'s target its own inputs, then `args`, by position and the other keys by
    name, and each nested `{target: ...}` its `in` (by name when a mapping), its `args`
    and its other keys. A required argument left out, or an input too many, failed when
    the run called the code: a `call` at its first run, after init and checkpoint 0; a
    `build` in init, after the run directory was made."""
    kwargs = step.kwargs
    if step.op == "call" and isinstance(kwargs.get("fn"), str):
        _bind(step, kwargs["fn"], len(step.ins), [k for k, _ in step.args if k not in OWN_KEYS["call"]], step.pos,
              f"its inputs ({len(step.ins)} in `in`) are its first positional arguments and the step's other "
              "keys its keyword arguments; rank, world_size, device, generator, step and epoch, when it names "
              "them without a default, come from the run")
    if step.op != "build":
        return
    from jobrun.ops.nested import nested_inputs

    args = kwargs.get("args")
    if isinstance(kwargs.get("target"), str) and isinstance(args, list | tuple | None):
        own = len(step.ins) - len(nested_inputs(args, kwargs))  # the nested targets' blobs come last
        _bind(step, kwargs["target"], own + len(args or ()), [k for k, _ in step.args if k not in OWN_KEYS["build"]],
              step.pos, f"its inputs ({own} in `in`) are its first positional arguments, then `args` "
              f"({len(args or ())}), and the step's other keys its keyword arguments")
    for arg, value in step.args:
        for target, keys, positional, pos in _nested(value):
            if positional is not None:
                _bind(step, target, positional, keys, pos or step.pos_of(arg),
                      "a nested target's `in` gives its first positional arguments (its keyword arguments, "
                      "when `in` is a mapping), then its `args`, and its other keys its keyword arguments")


def _bind(step: ir.OpCall, path: str, positional: int, keys: list[str], pos: Pos, hint: str) -> None:
    """Refuse at ``pos`` the code at ``path`` when ``positional`` values and ``keys`` (and
    the context a `call`'s function asks for) do not bind to its signature."""
    import inspect

    from jobrun.ops.core import asks_for
    from jobrun.ops.imports import resolve

    try:
        f = resolve(path, step.op, "fn" if step.op == "call" else "target")
        signature = inspect.signature(f)
    except (RunError, TypeError, ValueError):
        return  # not found is refused by check_code; no signature: nothing to check
    if hasattr(f, "__wrapped__"):
        return  # a decorator's wrapper may take other arguments than the code it wraps
    context = asks_for(f, positional) if step.op == "call" else ()
    try:
        signature.bind(*[None] * positional, **dict.fromkeys([*keys, *context]))
    except TypeError as e:
        raise PlanError(f"{step.op}: {getattr(f, '__name__', path)}{signature} cannot take what this step "
                        f"gives it: {e}", pos, hint) from e


def _nested(value: Any) -> Iterator[tuple[str, list[str], int | None, Pos | None]]:
    """(target, the keyword arguments it is given, how many positional ones (None: an
    `args` that is not a list), where the mapping is) of each nested mapping in a value."""
    if isinstance(value, dict):
        if isinstance(value.get("target"), str):
            named, args = value.get("in"), value.get("args")
            keys = [k for k in value if k not in ("target", "args", "in")] + (
                list(named) if isinstance(named, dict) else [])
            leading = len(named) if isinstance(named, list) else int(named is not None and not isinstance(named, dict))
            positional = leading + len(args or ()) if isinstance(args, list | tuple | None) else None
            yield value["target"], keys, positional, getattr(value, "pos", None)
        for v in value.values():
            yield from _nested(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _nested(v)


def _keywords(path: str, op: str, first: str | None) -> tuple[str, dict[str, Any]] | None:
    """The name of the code at `path` and the parameters a keyword can fill (less `first`,
    which the op gives); None when any keyword may do (`**kwargs`), or when there is no
    signature to check (code not found is refused by check_code; an import that raises
    is left to the run)."""
    import inspect

    from jobrun.ops.imports import resolve

    try:
        code = resolve(path, op, "target")
        params = inspect.signature(code).parameters
        # A decorator's wrapper (functools.wraps) may take keywords of its own beside the
        # code's: `inner(*args, scale=1.0, **kwargs)` around `double(x)` takes `scale`.
        outer = inspect.signature(code, follow_wrapped=False).parameters
    except (RunError, TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in (*params.values(), *outer.values())):
        return None  # any keyword may do: also a wrapper's **kwargs, which may take keys of its own
    return getattr(code, "__name__", path), {k: p for k, p in {**outer, **params}.items()
                                              if k not in ("self", first) and p.kind not in (
                                                  p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _known(step: ir.OpCall, name: str, params: dict[str, Any], key: str, pos: Pos,
           own: tuple[str, ...] = ()) -> None:
    """Refuse `key` when `name` has no parameter of that name; `own`: the keys the op
    takes itself, offered too (`mutate` for `call`'s `mutates`)."""
    if key not in params:
        from jobrun.errors import did_you_mean

        raise PlanError(f"{step.op}: {name} takes no argument {key!r}", pos,
                        did_you_mean(key, [*params, *own]) or f"its arguments: {', '.join(params) or 'none'}")


def _schedulers(plan: ir.Plan) -> dict[tuple[str, str], set[str | None]]:
    """(node, blob) -> the targets of the `scheduler`s that write it (None: a step that
    is not one, whose value may be anything). Blobs are a node's: two nodes, or private
    tasks of one, may each have a `sched` of another class."""
    made: dict[tuple[str, str], set[str | None]] = {}
    for (g, t, _k), step in _ordered(plan):
        target = step.kwargs.get("target") if step.op == "scheduler" else None
        for out in (*step.outs, *also_written(step)):
            made.setdefault((plan.groups[g].tasks[t].node, out.name), set()).add(target if isinstance(target, str) else None)
    return made


def _check_metric(step: ir.OpCall, target: str) -> None:
    """A metric given to a torch scheduler that takes none (StepLR took it as the epoch
    number: the rate never fell) or none given to one that steps on it (ReduceLROnPlateau
    failed after the first epoch), refused before the run by scheduler.step's own rule."""
    from jobrun.ops.imports import resolve
    from jobrun.ops.models import metric_fault

    try:
        fault = metric_fault(resolve(target, "scheduler", "target"), given=len(step.ins) > 1)
    except RunError:
        return  # refused above, or left to the run
    if fault is not None:
        raise PlanError(fault.message, step.pos, fault.hint)


def _named_code(step: ir.OpCall) -> Iterator[tuple[str, str, str]]:
    """(the argument, the key naming the code, its import path) for each piece of code
    one op call names: the key is the argument's own but in a nested mapping (`target`)."""
    from jobrun.ops.spec import LOSS_NAMES

    args = step.kwargs
    if step.op == "optimizer" and isinstance(args.get("class"), str):
        yield "class", "class", args["class"]  # torch.optim's; with a `target` too it is refused
    for key in CODE_ARGS.get(step.op, ()):
        path = args.get(key)
        if isinstance(path, str) and not (key == "loss" and path in LOSS_NAMES):
            yield key, key, path
    if step.op in NESTING:
        yield from ((key, "target", target) for key, value in step.args for target in _targets(value))


def _targets(value: Any) -> Iterator[str]:
    """The `target`s of the nested mappings in an argument's value."""
    if isinstance(value, dict):
        if isinstance(value.get("target"), str):
            yield value["target"]
        for v in value.values():
            yield from _targets(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _targets(v)
