"""Implementations of the core ops (signatures in :mod:`jobrun.ops.registry`).

Scalars stay Python scalars so that counting and stop conditions cost no tensor work;
torch is imported only by the ops that make or read tensors.
"""

from __future__ import annotations

import copy as _copy
import functools
import json
import math
import operator
import os
from functools import reduce
from typing import Any

from jobrun import safedel, safefs
from jobrun.errors import RunError
from jobrun.ops.context import OpContext

_DTYPES = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool",
}


def _torch():
    import torch

    return torch


def const(ctx: OpContext, value: Any = None) -> Any:
    if isinstance(value, list):
        torch = _torch()
        try:
            return torch.tensor(value, device=ctx.device)
        except (TypeError, ValueError) as e:
            raise RunError(
                f"const: cannot make a tensor of {value!r}: {e}", hint="use a list of numbers of equal lengths"
            ) from None
    return _copy.deepcopy(value)


def fill(ctx: OpContext, shape: list[int], value: float | int | bool = 0.0, dtype: str = "float32"):
    torch = _torch()
    return torch.full(tuple(shape), value, dtype=getattr(torch, dtype), device=ctx.device)


def randn(ctx: OpContext, shape: list[int], mean: float = 0.0, std: float = 1.0):
    torch = _torch()
    x = torch.randn(tuple(shape), generator=ctx.generator)
    if std != 1.0:
        x.mul_(std)
    if mean != 0.0:
        x.add_(mean)
    return x.to(ctx.device)


def copy(ctx: OpContext, a: Any) -> Any:
    clone = getattr(a, "clone", None)
    if callable(clone) and type(a).__module__.startswith("torch"):
        return clone()
    return _copy.deepcopy(a)


def add(ctx: OpContext, *xs: Any) -> Any:
    if len(xs) == 2:
        return xs[0] + xs[1]
    return reduce(operator.add, xs)


def mul(ctx: OpContext, *xs: Any) -> Any:
    if len(xs) == 2:
        return xs[0] * xs[1]
    return reduce(operator.mul, xs)


def sub(ctx: OpContext, a: Any, b: Any) -> Any:
    return a - b


def div(ctx: OpContext, a: Any, b: Any) -> Any:
    try:
        return a / b
    except ZeroDivisionError:
        raise RunError("div: division by zero", hint="guard the divisor with an `if`") from None


def ge(ctx: OpContext, a: Any, b: Any) -> Any:
    return a >= b


def gt(ctx: OpContext, a: Any, b: Any) -> Any:
    return a > b


def le(ctx: OpContext, a: Any, b: Any) -> Any:
    return a <= b


def lt(ctx: OpContext, a: Any, b: Any) -> Any:
    return a < b


def eq(ctx: OpContext, a: Any, b: Any) -> Any:
    return a == b


def ne(ctx: OpContext, a: Any, b: Any) -> Any:
    return a != b


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype")


def and_(ctx: OpContext, *xs: Any) -> Any:
    if any(_is_tensor(x) for x in xs):
        torch = _torch()
        return reduce(lambda a, b: torch.logical_and(torch.as_tensor(a), torch.as_tensor(b)), xs)
    return all(truthy(x) for x in xs)


def or_(ctx: OpContext, *xs: Any) -> Any:
    if any(_is_tensor(x) for x in xs):
        torch = _torch()
        return reduce(lambda a, b: torch.logical_or(torch.as_tensor(a), torch.as_tensor(b)), xs)
    return any(truthy(x) for x in xs)


def not_(ctx: OpContext, a: Any) -> Any:
    if _is_tensor(a) and a.numel() != 1:
        return _torch().logical_not(a)
    return not truthy(a)


def truthy(value: Any) -> bool:
    """Truth of a blob: a one-element tensor by its value; a larger tensor is an error."""
    if _is_tensor(value):
        if value.numel() != 1:
            raise RunError(
                f"a tensor of shape {tuple(value.shape)} has no single truth value",
                hint="reduce it first (e.g. with `call`) or compare a scalar",
            )
        return bool(value.item())
    return bool(value)


# -- log, save, load, call ------------------------------------------------------------


def plain(value: Any) -> Any:
    """A JSON-able form of a value for logs and .json files."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if _is_tensor(value):
        return plain(value.item() if value.numel() == 1 else value.detach().cpu().tolist())
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy
        return plain(value.tolist())
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return repr(value) if len(repr(value)) < 200 else f"<{type(value).__name__}>"


def log(ctx: OpContext, *values: Any, msg: str | None = None,
        _names: tuple[str, ...] = (), _clock: int | None = None) -> None:
    """`log`: record the values at the global step (``_clock``: the step its loop's
    iteration began at, given by the executor; else the step now). A step's `every: K`
    is the executor's (it runs the call at steps 0, K, 2K, ... only)."""
    record = {name: plain(v) for name, v in zip(_names, values)}
    if ctx.log is not None:
        ctx.log(record, msg, ctx.step if _clock is None else _clock)
    else:
        print(" ".join([msg or ""] + [f"{k}={v}" for k, v in record.items()]).strip())


log.wants_names = True  # type: ignore[attr-defined]
log.wants_clock = True  # type: ignore[attr-defined]


def _state_of(value: Any) -> Any:
    state_dict = getattr(value, "state_dict", None)
    return state_dict() if callable(state_dict) else value


SAVE_SUFFIXES = (".json", ".safetensors", ".pt")  # what `save` writes (and `jobrun export`)


def save_type_problem(path: str) -> tuple[str, str] | None:
    """(message, hint) when `save` cannot write a file of ``path``'s type, else None: the
    op's rule, which `train` checks before the run too (jobrun.plans.inputs)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in SAVE_SUFFIXES:
        return None
    return f"save: unknown file type {suffix or '(none)'!r} for {path}", "use .json, .safetensors or .pt"


def save(ctx: OpContext, *values: Any, path: str, _names: tuple[str, ...] = ()) -> None:
    if ctx.distributed and ctx.parallel == "fsdp":
        from jobrun.ops.fsdp import gathered

        values = gathered(values, ctx.rank)  # every rank sends its shards; rank 0 writes
    if ctx.rank != 0:
        return  # replicas hold the same values; one writer, no race on the file
    target = ctx.resolve_write(path)
    suffix = target.suffix.lower()
    named = dict(zip(_names, values))
    if suffix == ".json":
        data = (json.dumps({k: plain(v) for k, v in named.items()}, indent=2) + "\n").encode()
        fill = lambda f: f.write(data)  # noqa: E731
    elif suffix == ".safetensors":
        from safetensors.torch import save as to_bytes

        data = to_bytes(_flat_tensors(named))  # the library writes to a path of its own, or to memory
        fill = lambda f: f.write(data)  # noqa: E731
    elif suffix == ".pt":
        torch = _torch()
        fill = lambda f: torch.save({k: _state_of(v) for k, v in named.items()}, f)  # noqa: E731
    else:
        raise RunError(*save_type_problem(path))  # type: ignore[misc]
    try:
        safefs.make_dirs_under(ctx.run_dir, target.parent)
        safefs.write_with(target, fill)
        safedel.record_written(ctx.run_dir, target)  # train --overwrite deletes it then
    except safefs.UnsafeFile as e:
        raise RunError(f"save: refusing to write {target}: {e.strerror}",
                       hint="remove it, or save to another path") from None


save.wants_names = True  # type: ignore[attr-defined]


def _flat_tensors(named: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a .safetensors save, by name. Tensors that share memory (tied
    weights: a GPT's lm_head and its token embedding) are each written under their own
    name, as `jobrun export` writes them, so `load_state_dict(strict=True)` finds every
    key: the library refuses shared memory, so a later one gets a copy of its own, as a
    checkpoint's tensor file does (store.tensorfile.distinct)."""
    from jobrun.store.tensorfile import distinct

    torch = _torch()
    out: dict[str, Any] = {}
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            out[name] = value.detach().cpu().contiguous()
            continue
        state = _state_of(value)
        if not isinstance(state, dict):
            raise RunError(f"save: blob {name!r} is a {type(value).__name__}, not a tensor or module",
                           hint="save it to a .json file instead")
        for key, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise RunError(f"save: {name}.{key} is not a tensor", hint="use .pt for mixed state")
            out[f"{name}.{key}"] = t.detach().cpu().contiguous()
    return distinct(out)


def load(ctx: OpContext, path: str, _out_names: tuple[str, ...] = ()) -> Any:
    source = ctx.resolve_read(path)
    if not source.exists():
        raise RunError(f"load: no such file {source}", hint="check `path` (relative to the plan's directory)")
    suffix = source.suffix.lower()
    if suffix == ".json":
        data = json.loads(source.read_text())
    elif suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            data = _nest(load_file(source), _out_names)
        except SafetensorError as e:
            raise RunError(f"load: cannot read {source}: {e}",
                           hint="the file is damaged or is not a safetensors file") from e
    elif suffix == ".pt":
        torch = _torch()
        data = torch.load(source, map_location="cpu", weights_only=True)
    else:
        raise RunError(f"load: unknown file type {suffix!r} for {path}", hint="use .json, .safetensors or .pt")
    missing = [n for n in _out_names if n not in data]
    if missing:
        raise RunError(f"load: {source.name} has no {', '.join(missing)}",
                       hint=f"it holds: {', '.join(sorted(data)) or 'nothing'}")
    results = tuple(data[n] for n in _out_names)
    return results[0] if len(results) == 1 else results


load.wants_out_names = True  # type: ignore[attr-defined]


def checkpoint_load(ctx: OpContext, *values: Any, epoch: int | str = "best",
                    _names: tuple[str, ...] = ()) -> None:
    """Load what this run's checkpoint of `epoch` (a number, best or last) holds of the
    named blobs into them, in place (Lightning's `trainer.test(ckpt_path="best")`); the
    runner reads the checkpoint as a resume does (runner/checkpoints.py)."""
    if ctx.load_checkpoint is None:
        raise RunError("checkpoint.load reads the checkpoints of a run: it runs only in a job",
                       hint="run the plan with `jobrun train`")
    ctx.load_checkpoint(dict(zip(_names, values)), epoch)


checkpoint_load.wants_names = True  # type: ignore[attr-defined]


def _nest(flat: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """Tensors saved as `<blob>.<key>` (a module's state) come back as one dict per blob;
    one output that names no key nor prefix gets the whole file (a state dict that
    `jobrun export` of one module wrote, or any plain safetensors file)."""
    out: dict[str, Any] = dict(flat)
    for name in names:
        if name in flat:
            continue
        prefix = name + "."
        state = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
        if state:
            out[name] = state
        elif len(names) == 1:
            out[name] = dict(flat)
    return out


# What `call` passes to a function whose signature names them (and the plan does not).
CONTEXT_ARGS = ("rank", "world_size", "device", "generator", "step", "epoch")


def call(ctx: OpContext, *args: Any, fn: str, mutates: list[str] | None = None,
         pure: bool = False, _clock: int | None = None, _names: tuple[str, ...] = (),
         _site: str = "", **kwargs: Any) -> Any:
    """`call`: fn(*inputs, **other keys, **context it asks for). `mutates` and `pure` are
    for checkpoints, not for `fn`. A parameter of `fn` without a default named rank,
    world_size, device, generator (the node's seeded torch.Generator), step (the global
    step) or epoch (the epoch running: 0 in init, the last one in download and exit), not filled by the inputs nor by the plan, receives the run's value. When `fn`
    raises and an input is null, the error names that input first: torch's message about
    a NoneType says nothing of the `read` that reached its end."""
    from jobrun.ops.imports import resolve

    f = resolve(fn, "call", "fn")
    for name in asks_for(f, len(args)):
        if name not in kwargs:
            if name == "step" and _clock is not None:
                kwargs[name] = _clock  # the step its loop's iteration began at, as log's
            else:
                kwargs[name] = getattr(ctx, name, 0)  # `step`: 0 where no global step is kept
    # What it says decides what checkpoints hold of the steps of `epoch` only (resume runs
    # init again; download and exit are in none: plans/state.py), so it is watched there.
    said = None if _site and not _site.startswith("epoch/") else [] if pure else mutates
    try:
        if said is None:
            return f(*args, **kwargs)
        from jobrun.runner import clock

        with clock.stepped() as stepped:
            result = f(*args, **kwargs)
    except Exception as e:
        nulls = [k for k, a in enumerate(args) if a is None]
        if not nulls:
            raise
        raise null_inputs(f"{fn} failed ({type(e).__name__})", nulls, _names) from e
    if stepped:
        _check_said(fn, args, _names, said, stepped, "pure: true" if pure else f"mutates: [{', '.join(said)}]")
    return result


def _check_said(fn: str, args: tuple, names: tuple[str, ...], said: list[str], stepped: list,
                saying: str) -> None:
    """A call that says what it changes (`mutates`, `pure`) and steps an optimizer among
    its inputs, or one over the parameters of a model among them, that it leaves out: its
    checkpoints would hold neither, and a resume would go on with them as init made them."""
    params = {id(p) for opt in stepped for group in opt.param_groups for p in group["params"]}
    names = tuple(names) + tuple(f"#{k + 1}" for k in range(len(names), len(args)))

    def changed() -> list[str]:
        return [name for name, a in zip(names, args) if name not in said and (
            any(a is opt for opt in stepped) or any(id(p) in params for p in _parameters(a)))]

    left = changed()
    if left:  # a parameter that an input it says it changes holds is in that one's checkpoint,
        # restored in place (a layer a frozen teacher shares with the student comes back with it)
        params -= {id(p) for name, a in zip(names, args) if name in said for p in _parameters(a)}
        left = changed()
    if left:
        which = ", ".join(repr(n) for n in left)
        error = RunError(
            f"{fn} took an optimizer step that changed {which}, which the call's `{saying}` leaves "
            "out: checkpoints hold only what steps change, so a resume would go on with "
            f"{which} as init made {'them' if len(left) > 1 else 'it'}",
            hint=f"list every input it changes: `mutates: [{', '.join(n for n in names if n in said or n in left)}]`")
        error.every_rank = True  # every replica takes the step (DDP's): the plan's error, said once
        raise error


def _parameters(value: Any) -> Any:
    """A module's parameters (another object's `parameters` may want arguments of its own)."""
    import torch

    return value.parameters() if isinstance(value, torch.nn.Module) else ()


def null_inputs(failure: str, nulls: list[int], names: tuple[str, ...]) -> RunError:
    """The error of a step that failed on null inputs (positions ``nulls`` of ``names``):
    the usual cause is a `read` past the end of its pass, whose fields are null."""
    shown = [repr(names[k]) if k < len(names) else f"#{k + 1}" for k in nulls]
    which = f"input {shown[0]}" if len(shown) == 1 else f"inputs {', '.join(shown)}"
    return RunError(f"{failure} with null (None) {which}", hint=NULL_HINT)


NULL_HINT = ("a `read` past the end of a pass gives null fields (and a true `end`): put "
             "`stop_if: end` right after the read, or give the reader `passes: 0`; else "
             "the step that made the blob returned None")


call.wants_clock = True  # type: ignore[attr-defined]
call.wants_names = True  # type: ignore[attr-defined]
call.wants_site = True  # type: ignore[attr-defined]  # its group: `epoch/...`


@functools.lru_cache(maxsize=256)
def asks_for(f: Any, positional: int) -> tuple[str, ...]:
    """The context names `f`'s signature takes by keyword, past its first `positional`."""
    import inspect

    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature asks for nothing
        return ()
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params[:positional + 1]):
        positional = len(params)  # *args takes the inputs: only keyword-only ones are free
    bound = {p.name for p in params[:positional] if p.kind in by_position}
    # Only parameters without a default ask: one with a default has a meaning of its own
    # (tests' die_once(..., rank=1) names the rank to kill), and before the context was
    # passed a required one failed, so no plan that ran changes its behaviour.
    return tuple(p.name for p in params if p.name in CONTEXT_ARGS and p.name not in bound
                 and p.kind is not inspect.Parameter.POSITIONAL_ONLY
                 and p.default is inspect.Parameter.empty)
