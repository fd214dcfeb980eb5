"""Implementations of the training ops (signatures in :mod:`jobrun.ops.train_specs`).

Data parallelism: with ``ctx.world_size = R > 1`` the runner has initialised
torch.distributed (gloo on CPU, nccl on CUDA) and every rank runs the same ops on its own
slice of each global batch (see :mod:`jobrun.ops.reader`). The ops here keep ranks
identical: models are built from the node's seeded generator and broadcast from rank 0,
``train.step`` sums gradients weighted by each rank's share of the global batch, and
``evaluate`` reduces its sums over ranks. Every collective is issued by every rank in the
same order, also by a rank whose slice is empty.
"""

from __future__ import annotations

import builtins
import contextlib
import csv
import functools
import importlib
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jobrun.errors import RunError, did_you_mean
from jobrun.ops.context import OpContext
from jobrun.ops.reader import Reader

# --------------------------------------------------------------------------- helpers


def resolve_target(target: Any, what: str = "target") -> Any:
    """The object named by "pkg.mod:Name" or a dotted "pkg.mod.Name"."""
    if not isinstance(target, str) or not target.strip():
        raise RunError(f"{what} must be a dotted path like 'torch.optim.SGD', got {target!r}")
    if ":" in target:
        module_name, _, attr_path = target.partition(":")
        return _getattr_path(_import(module_name, target), attr_path.split("."), target)
    parts = target.split(".")
    if len(parts) == 1 and hasattr(builtins, target):
        return getattr(builtins, target)
    # The longest importable prefix is the module; the rest are attributes.
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue
            raise _import_error(target, e) from e
        except Exception as e:  # the module exists but failed while importing
            raise _import_error(target, e) from e
        return _getattr_path(module, parts[i:], target)
    raise RunError(
        f"cannot import {target!r}: no such module",
        hint="check the spelling; is the package installed and on PYTHONPATH?",
    )


def _import(module_name: str, target: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise _import_error(target, e) from e


def _import_error(target: str, e: Exception) -> RunError:
    return RunError(
        f"cannot import {target!r}: {type(e).__name__}: {e}",
        hint="check the spelling; is the package installed and on PYTHONPATH?",
    )


def _getattr_path(obj: Any, names: list[str], target: str) -> Any:
    for name in names:
        if not hasattr(obj, name):
            public = [n for n in dir(obj) if not n.startswith("_")]
            raise RunError(
                f"cannot resolve {target!r}: {getattr(obj, '__name__', obj)!s} has no "
                f"attribute {name!r}",
                hint=did_you_mean(name, public) or "check the spelling of the dotted path",
            )
        obj = getattr(obj, name)
    return obj


def _call(fn: Any, target: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Call user-named code; its failures become one clear RunError."""
    if not callable(fn):
        raise RunError(f"{target!r} is a {type(fn).__name__}, not something callable")
    try:
        return fn(*args, **kwargs)
    except RunError:
        raise
    except Exception as e:
        raise RunError(
            f"{target}(...) failed: {type(e).__name__}: {e}",
            hint="check the arguments given in the plan against its signature",
        ) from e


@contextlib.contextmanager
def _seeded(ctx: OpContext) -> Iterator[None]:
    """Construct under a seed drawn from the node's generator: same on every rank.

    Only the CPU generator is reseeded (and restored after): module initialisation
    draws from it, and the global CUDA streams stay as the job left them.
    """
    seed = int(torch.randint(0, 2**62, (1,), generator=ctx.generator))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def _place_module(ctx: OpContext, module: nn.Module) -> nn.Module:
    module = module.to(ctx.device)
    if ctx.distributed:  # cheap insurance: parameters start identical on every rank
        with torch.no_grad():
            _broadcast_tensors(ctx, [*module.parameters(), *module.buffers()], src=0)
    return module


def _as_tensor(value: Any, device: torch.device | str, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        # `.to` costs a dispatch even when it does nothing: skip it on the CPU hot path.
        if device == "cpu" and value.is_cpu:
            return value
        return value.to(device)
    if value is None:
        raise RunError(
            f"{what} is null",
            hint="a `read` at the end of a pass gives null fields; check `done` before use",
        )
    try:
        return torch.as_tensor(np.asarray(value)).to(device)
    except Exception as e:
        raise RunError(f"{what} cannot be made a tensor: {type(value).__name__}") from e


def _count(y: torch.Tensor) -> int:
    """Records in a batch; an unbatched record (a 0-d label) counts as one."""
    return int(y.shape[0]) if y.dim() > 0 else 1


# ------------------------------------------------------------------ distributed plumbing


def _comm_device(ctx: OpContext) -> torch.device:
    # nccl only moves CUDA tensors; gloo is used with CPU tensors.
    if torch.distributed.get_backend() == "nccl":
        return torch.device(ctx.device)
    return torch.device("cpu")


def _flat_buckets(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _broadcast_tensors(ctx: OpContext, tensors: Sequence[torch.Tensor], src: int) -> None:
    """Overwrite `tensors` in place with rank `src`'s values, one collective per dtype."""
    if not tensors:
        return
    dev = _comm_device(ctx)
    for idxs in _flat_buckets(tensors).values():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(dev) for i in idxs])
        torch.distributed.broadcast(flat, src=src)
        for i, chunk in zip(idxs, flat.split([tensors[i].numel() for i in idxs])):
            tensors[i].data.copy_(chunk.view_as(tensors[i]))


class _GlobalCount:
    """The global batch size, all-reduced in the background while the forward runs."""

    def __init__(self, ctx: OpContext, local: int) -> None:
        self._value: int | None = None if ctx.distributed else local
        if ctx.distributed:
            self._tensor = torch.tensor([local], dtype=torch.int64, device=_comm_device(ctx))
            self._work = torch.distributed.all_reduce(self._tensor, async_op=True)

    @property
    def value(self) -> int:
        if self._value is None:
            self._work.wait()
            self._value = int(self._tensor.item())
        return self._value


def _allreduce_grads(ctx: OpContext, params: list[torch.Tensor], loss: torch.Tensor) -> float:
    """Sum gradients (one flat bucket per dtype) and the loss over ranks.

    A rank whose slice was empty has no gradients; a per-parameter "has a gradient" flag
    rides in the float32 bucket with the loss, so that a parameter no rank touched keeps
    grad=None as in a single process (optimizers skip those), at no extra collective.
    """
    dev = _comm_device(ctx)
    has = [p.grad is not None for p in params]
    meta = torch.cat(
        [torch.tensor(has, dtype=torch.float32, device=dev), loss.float().reshape(1).to(dev)]
    )
    reduced_meta = meta
    groups = _flat_buckets(params)
    groups.setdefault(torch.float32, [])
    for dtype, idxs in groups.items():
        parts = [(params[i].grad if has[i] else torch.zeros_like(params[i])) for i in idxs]
        parts = [g.reshape(-1).to(dev) for g in parts]
        if dtype == torch.float32:
            parts.append(meta)
        flat = torch.cat(parts)
        torch.distributed.all_reduce(flat)
        _scatter_grads(params, idxs, flat)
        if dtype == torch.float32:
            reduced_meta = flat[flat.numel() - meta.numel() :]
    flags = reduced_meta[: len(params)].tolist()
    for p, flag in zip(params, flags):
        if flag == 0:
            p.grad = None
    return float(reduced_meta[-1].item())


def _scatter_grads(params: list[torch.Tensor], idxs: list[int], flat: torch.Tensor) -> None:
    sizes = [params[i].numel() for i in idxs]
    for i, chunk in zip(idxs, flat[: sum(sizes)].split(sizes)):
        p = params[i]
        chunk = chunk.view_as(p).to(p.device)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)


# ------------------------------------------------------------------------------ data


def data_synthetic(
    ctx: OpContext,
    *,
    task: str,
    n: int,
    features: int,
    classes: int | None = None,
    noise: float = 0.1,
    seed: int = 0,
    sample_seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Points around random class centres, or a noisy linear teacher.

    A dedicated CPU generator (not the node's) makes the data a function of `seed`
    alone; teachers are computed in float64 and rounded, so machines agree. The problem
    (centres, teacher) comes from `seed`; the points from `sample_seed` when given, so a
    validation set is the same problem with other samples.
    """
    _require_int("data.synthetic", "n", n, 1)
    _require_int("data.synthetic", "features", features, 1)
    if noise < 0:
        raise RunError(f"data.synthetic: noise must be >= 0, got {noise}")
    gen = torch.Generator().manual_seed(int(seed))
    if task == "classification":
        if classes is None:
            raise RunError("data.synthetic: classification needs `classes`", hint="classes: 3")
        _require_int("data.synthetic", "classes", classes, 2)
        centers = torch.randn(classes, features, generator=gen, dtype=torch.float64)
        if sample_seed is not None:
            gen = torch.Generator().manual_seed(int(sample_seed))
        y = torch.randint(0, classes, (n,), generator=gen)
        jitter = torch.randn(n, features, generator=gen, dtype=torch.float64)
        return (centers[y] + noise * jitter).float(), y
    if task == "regression":
        w = torch.randn(features, 1, generator=gen, dtype=torch.float64)
        b = torch.randn(1, generator=gen, dtype=torch.float64)
        if sample_seed is not None:
            gen = torch.Generator().manual_seed(int(sample_seed))
        x = torch.randn(n, features, generator=gen, dtype=torch.float64)
        eps = torch.randn(n, 1, generator=gen, dtype=torch.float64)
        y = (x * w.T).sum(dim=1, keepdim=True) + b + noise * eps
        return x.float(), y.float()
    raise RunError(
        f"data.synthetic: unknown task {task!r}",
        hint="task is 'classification' or 'regression'",
    )


def _require_int(op: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RunError(f"{op}: {name} must be an integer >= {minimum}, got {value!r}")


_FLOAT_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def data_load(
    ctx: OpContext,
    *,
    path: str,
    keys: list[str] | None = None,
    columns: list[Any] | None = None,
    header: bool | None = None,
    delimiter: str = ",",
    float_dtype: str | None = "float32",
) -> Any:
    """Arrays from a file, as CPU tensors, one output per array (see train_specs)."""
    file = ctx.resolve_read(path)
    if not file.is_file():
        raise RunError(
            f"data.load: no such file {str(file)!r}",
            hint="relative paths are resolved against the plan file's directory",
        )
    if float_dtype is not None and float_dtype not in _FLOAT_DTYPES:
        raise RunError(
            f"data.load: unknown float_dtype {float_dtype!r}",
            hint=f"one of {sorted(_FLOAT_DTYPES)} or null to keep the stored type",
        )
    suffix = file.suffix.lower()
    if suffix != ".csv" and columns is not None:
        raise RunError("data.load: `columns` applies to .csv files only")
    if suffix == ".npz":
        values = _load_npz(file, keys)
    elif suffix == ".npy":
        values = [_np_load(file)]
    elif suffix == ".csv":
        values = _load_csv(file, columns, header, delimiter)
    elif suffix == ".safetensors":
        values = _pick(_load_safetensors(file), keys, file)
    elif suffix == ".pt":
        values = _load_pt(file, keys)
    else:
        raise RunError(
            f"data.load: unsupported file type {suffix or '(none)'!r} for {file.name!r}",
            hint="supported: .npz, .npy, .csv, .safetensors, .pt",
        )
    tensors = [_to_torch(v, float_dtype, file) for v in values]
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _np_load(file: Path) -> Any:
    try:
        return np.load(file, allow_pickle=False)
    except Exception as e:  # object arrays need pickle, which is never allowed
        raise RunError(
            f"data.load: cannot read {file.name!r}: {e}",
            hint="only numeric arrays can be loaded (pickled objects are refused)",
        ) from e


def _load_npz(file: Path, keys: list[str] | None) -> list[Any]:
    with _np_load(file) as archive:
        return [archive[k] for k in _check_keys(keys, list(archive.files), file)]


def _check_keys(keys: list[str] | None, available: list[str], file: Path) -> list[str]:
    if keys is None:
        return available
    for k in keys:
        if k not in available:
            raise RunError(
                f"data.load: {file.name!r} has no array {k!r}; it has {available}",
                hint=did_you_mean(k, available),
            )
    return list(keys)


def _pick(mapping: dict[str, Any], keys: list[str] | None, file: Path) -> list[Any]:
    return [mapping[k] for k in _check_keys(keys, list(mapping), file)]


def _load_safetensors(file: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except SafetensorError as e:
        raise RunError(f"data.load: cannot read {file.name!r}: {e}",
                       hint="the file is damaged or is not a safetensors file") from e


def _load_pt(file: Path, keys: list[str] | None) -> list[Any]:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RunError(
            f"data.load: cannot read {file.name!r}: {type(e).__name__}: {e}",
            hint="only tensors and dicts/lists of tensors load (weights_only=True)",
        ) from e
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return _pick(obj, keys, file)
    if isinstance(obj, list | tuple):
        return list(obj)
    raise RunError(f"data.load: {file.name!r} holds a {type(obj).__name__}, not tensors")


def _load_csv(
    file: Path, columns: list[Any] | None, header: bool | None, delimiter: str
) -> list[Any]:
    with file.open(newline="") as fh:
        rows = [r for r in csv.reader(fh, delimiter=delimiter) if r]
    if not rows:
        raise RunError(f"data.load: {file.name!r} is empty")
    if header is None:  # a first row that is not all numbers is a header
        header = not all(_is_number(c) for c in rows[0])
    names = [c.strip() for c in rows[0]] if header else []
    body = rows[1:] if header else rows
    try:
        table = np.array([[float(c) for c in r] for r in body], dtype=np.float64)
    except ValueError as e:
        raise RunError(
            f"data.load: {file.name!r} has a non-numeric or ragged row: {e}",
            hint="CSV files must be numeric, with an optional header row",
        ) from e
    table = table.reshape(len(body), -1) if body else np.zeros((0, len(rows[0])))
    if columns is None:
        return [table]
    return [table[:, _column_index(c, names, table.shape[1], file)] for c in columns]


def _column_index(col: Any, names: list[str], width: int, file: Path) -> Any:
    if isinstance(col, list):
        return [_column_index(c, names, width, file) for c in col]
    if isinstance(col, int) and not isinstance(col, bool) and -width <= col < width:
        return col
    if isinstance(col, str) and col in names:
        return names.index(col)
    raise RunError(
        f"data.load: {file.name!r} has no column {col!r}"
        + (f"; columns: {names}" if names else f" ({width} columns, no header)"),
        hint=did_you_mean(str(col), names) if names else "use 0-based column numbers",
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _to_torch(value: Any, float_dtype: str | None, file: Path) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise RunError(f"data.load: {file.name!r} holds a non-numeric array ({value.dtype})")
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise RunError(f"data.load: {file.name!r} holds a {type(value).__name__}, not a tensor")
    if float_dtype is not None and value.is_floating_point():
        value = value.to(_FLOAT_DTYPES[float_dtype])
    return value


# ---------------------------------------------------------------- models and optimizers


def _materialize(value: Any) -> Any:
    """Instantiate nested `{target: ..., args: [...], **kwargs}` mappings, depth first."""
    if isinstance(value, dict):
        if "target" in value:
            rest = {k: v for k, v in value.items() if k not in ("target", "args")}
            return _instantiate(value["target"], value.get("args") or [], rest)
        return {k: _materialize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_materialize(v) for v in value]
    return value


def _instantiate(target: Any, args: Any, kwargs: dict[str, Any], leading: tuple = ()) -> Any:
    if not isinstance(args, list | tuple):
        raise RunError(f"build: `args` of {target!r} must be a list, got {args!r}")
    fn = resolve_target(target, "build target")
    return _call(fn, target, [*leading, *_materialize(list(args))], _materialize(kwargs))


def build(ctx: OpContext, *inputs: Any, target: str, args: list | None = None, **kwargs: Any):
    """`build`: inputs... -> obj. Seeded like model.mlp, so identical on every rank."""
    with _seeded(ctx):
        obj = _instantiate(target, args or [], kwargs, leading=inputs)
    return _place_module(ctx, obj) if isinstance(obj, nn.Module) else obj


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
}


def model_mlp(
    ctx: OpContext, *, sizes: list[int], activation: str = "relu", dropout: float = 0.0
) -> nn.Module:
    """`model.mlp`: an nn.Sequential of Linear layers, activation (+ dropout) between."""
    if not isinstance(sizes, list | tuple) or len(sizes) < 2:
        raise RunError(f"model.mlp: sizes must list [in, hidden..., out], got {sizes!r}")
    for s in sizes:
        _require_int("model.mlp", "every size", s, 1)
    if activation not in _ACTIVATIONS:
        raise RunError(
            f"model.mlp: unknown activation {activation!r}",
            hint=did_you_mean(activation, _ACTIVATIONS) or f"one of {sorted(_ACTIVATIONS)}",
        )
    if not 0.0 <= dropout < 1.0:
        raise RunError(f"model.mlp: dropout must be in [0, 1), got {dropout}")
    with _seeded(ctx):
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(_ACTIVATIONS[activation]())
                if dropout > 0:
                    layers.append(nn.Dropout(dropout))
        model = nn.Sequential(*layers)
    return _place_module(ctx, model)


def optimizer(ctx: OpContext, model: Any, *, target: str = "torch.optim.SGD", **kwargs: Any):
    """`optimizer`: model -> opt; every other key goes to the optimizer's constructor."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    fn = resolve_target(target, "optimizer target")
    return _call(fn, target, [params], _materialize(kwargs))


def scheduler(ctx: OpContext, opt: Any, *, target: str, **kwargs: Any):
    """`scheduler`: opt -> sched, e.g. target: torch.optim.lr_scheduler.StepLR."""
    _require_optimizer("scheduler", opt)
    fn = resolve_target(target, "scheduler target")
    return _call(fn, target, [opt], _materialize(kwargs))


def scheduler_step(ctx: OpContext, sched: Any, metric: Any = None) -> None:
    """`scheduler.step`: sched[, metric] ->. The metric feeds ReduceLROnPlateau."""
    if not hasattr(sched, "step"):
        raise RunError(f"scheduler.step expects a scheduler, got a {type(sched).__name__}")
    if metric is None:
        sched.step()
    else:
        sched.step(float(metric))


def _require_optimizer(op: str, opt: Any) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise RunError(
            f"{op} expects an optimizer, got a {type(opt).__name__}",
            hint="create one with `optimizer: {in: model, out: opt, lr: 0.1}`",
        )


# ------------------------------------------------------------------------- training


_LONG = torch.long


def _cross_entropy(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.dtype is _LONG and pred.ndim == 2:
        # The common case first, in attribute reads: each method call here costs ~1 us
        # between the step's kernels (cold caches), a tiny model's step ~400 us.
        return F.cross_entropy(pred, y)
    if y.is_floating_point() and y.dim() == pred.dim() - 1:
        y = y.long()  # class indices stored as floats (e.g. read from a CSV file)
    if pred.dim() > 2 and y.dim() == pred.dim() - 1:
        # sequence outputs [B, T, V] against labels [B, T]: one class per position
        return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), y.reshape(-1))
    return F.cross_entropy(pred, y)


def _mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if not y.is_floating_point():
        y = y.to(pred.dtype)
    if y.shape != pred.shape and y.numel() == pred.numel():
        y = y.reshape(pred.shape)  # [n] targets against [n, 1] predictions
    return F.mse_loss(pred, y)


_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "mse": _mse,
}


@functools.lru_cache(maxsize=64)
def _loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss by name; a dotted path names a callable(pred, y) giving the batch mean."""
    if name in _LOSSES:
        return _LOSSES[name]
    if "." in name or ":" in name:
        fn = resolve_target(name, "loss")
        if not callable(fn):
            raise RunError(f"loss {name!r} is not callable")
        return fn
    raise RunError(
        f"unknown loss {name!r}",
        hint=did_you_mean(name, _LOSSES) or "cross_entropy, mse, or a dotted path",
    )


_AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}
_warned_amp_on_cpu = False


def _amp_dtype(ctx: OpContext, amp: str | None) -> torch.dtype | None:
    global _warned_amp_on_cpu
    if amp is None:
        return None
    if amp not in _AMP:
        raise RunError(f"train.step: unknown amp {amp!r}", hint="amp is null, bf16 or fp16")
    if torch.device(ctx.device).type != "cuda":
        if not _warned_amp_on_cpu:  # once per process: the hot loop must not spam
            warnings.warn(f"amp={amp} is ignored on {ctx.device}", RuntimeWarning, stacklevel=3)
            _warned_amp_on_cpu = True
        return None
    return _AMP[amp]


def _scaler(opt: Any) -> Any:
    # Kept on the optimizer so that it lives (and is checkpointed) with it.
    scaler = getattr(opt, "_jobrun_scaler", None)
    if scaler is None:
        scaler = torch.amp.GradScaler("cuda")
        opt._jobrun_scaler = scaler
    return scaler


def _micro_batches(x: torch.Tensor, y: torch.Tensor, accumulate: int):
    if accumulate == 1 or y.dim() == 0:
        return [(x, y)]
    if x.shape[0] != y.shape[0]:
        raise RunError(
            f"train.step: x has {x.shape[0]} records, y has {y.shape[0]}",
            hint="accumulate splits the first dimension of x and y; they must agree",
        )
    return list(zip(x.tensor_split(accumulate), y.tensor_split(accumulate)))


def _trained_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def train_step(
    ctx: OpContext,
    model: Any,
    opt: Any,
    x: Any,
    y: Any,
    *,
    loss: str = "cross_entropy",
    clip_grad_norm: float | None = None,
    accumulate: int = 1,
    amp: str | None = None,
) -> float:
    """`train.step`: one optimizer step; returns the loss averaged over the global batch.

    Each micro-batch's mean loss is weighted by its share of the global batch, so the
    summed gradients equal those of one process reading the whole global batch.
    """
    _require_optimizer("train.step", opt)
    _require_int("train.step", "accumulate", accumulate, 1)
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise RunError(f"train.step: clip_grad_norm must be > 0, got {clip_grad_norm}")
    loss_fn = _loss_fn(loss)
    dtype = _amp_dtype(ctx, amp)
    if not ctx.distributed and accumulate == 1 and dtype is None:
        return _plain_step(loss_fn, clip_grad_norm, None, ctx, model, opt, x, y)
    scaler = _scaler(opt) if dtype is torch.float16 else None
    x = _as_tensor(x, ctx.device, "train.step input x")
    y = _as_tensor(y, ctx.device, "train.step input y")
    total_n = _GlobalCount(ctx, _count(y))  # overlaps with the first forward
    opt.zero_grad(set_to_none=True)
    total = _backward(model, loss_fn, _micro_batches(x, y, accumulate), total_n, dtype, scaler)
    _check_total(total_n.value)  # after the backward, so that every rank raises or none does
    params = _trained_params(opt) if ctx.distributed or clip_grad_norm else []
    value = _allreduce_grads(ctx, params, total) if ctx.distributed else float(total)
    if scaler is not None:
        scaler.unscale_(opt)
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, float(clip_grad_norm))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if ctx.distributed and isinstance(model, nn.Module):
        with torch.no_grad():  # e.g. BatchNorm running statistics follow rank 0
            _broadcast_tensors(ctx, list(model.buffers()), src=0)
    return value


_Optimizer = torch.optim.Optimizer
_Tensor = torch.Tensor


def _plain_step(loss_fn, clip_grad_norm, last: list | None, ctx: OpContext, model, opt, x, y) -> float:
    """One process, one micro-batch, full precision: what a hand-written loop does.

    Every line runs once per training step, between torch's kernels, where Python work
    costs several times what a micro-benchmark shows (cold caches): CPU tensors skip the
    conversions. The arguments come first so that a call site can bind them with
    `functools.partial` (see `_bind_train_step`). ``last``, a call site's one-item list,
    keeps the step's loss tensor (and the autograd nodes behind it) until the next step,
    as a hand-written loop's ``loss`` variable does: freeing them then, as the next
    forward allocates, measured 1.5-2.5 µs a step cheaper than freeing them on return.
    """
    if not isinstance(opt, _Optimizer):
        _require_optimizer("train.step", opt)
    if not (
        x.__class__ is _Tensor and y.__class__ is _Tensor
        and x.is_cpu and y.is_cpu and ctx.device == "cpu"
    ):  # fmt: skip
        x = _as_tensor(x, ctx.device, "train.step input x")
        y = _as_tensor(y, ctx.device, "train.step input y")
    shape = y.shape
    if shape and not shape[0]:
        _check_total(0)  # raises: an empty batch
    opt.zero_grad(set_to_none=True)
    out = loss_fn(model(x), y)
    out.backward()
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(_trained_params(opt), float(clip_grad_norm))
    opt.step()
    if last is not None:
        last[0] = out
    return out.item()


def _bind_train_step(
    ctx: OpContext,
    *,
    loss: str = "cross_entropy",
    clip_grad_norm: float | None = None,
    accumulate: int = 1,
    amp: str | None = None,
) -> Callable[..., float] | None:
    """One call site's `train.step` with its arguments checked once (see the executor).

    The plain case only (one process, accumulate 1, no amp); None for any other, and for
    a wrong argument, whose error the unbound op then raises at run time, as before.
    A loss named by a dotted path is looked up on every call (a cache hit), as the op
    does: it imports user code, which must not happen before the job runs.
    """
    if ctx.distributed or amp is not None or type(accumulate) is not int or accumulate != 1:
        return None
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        return None
    if loss in _LOSSES:  # a functools.partial adds no Python frame to the call
        return functools.partial(_plain_step, _LOSSES[loss], clip_grad_norm, [None])

    last: list = [None]

    def step(ctx: OpContext, model: Any, opt: Any, x: Any, y: Any) -> float:
        if not isinstance(opt, _Optimizer):  # the op's order: the optimizer, then the loss
            _require_optimizer("train.step", opt)
        return _plain_step(_loss_fn(loss), clip_grad_norm, last, ctx, model, opt, x, y)

    return step


train_step.bind = _bind_train_step  # type: ignore[attr-defined]


def _backward(model, loss_fn, batches, total_n: _GlobalCount, dtype, scaler) -> torch.Tensor:
    """Forward and backward every micro-batch; the weighted loss sum (detached)."""
    total: torch.Tensor | None = None
    for xb, yb in batches:
        n = _count(yb)
        if n == 0:
            continue  # an empty slice of a short global batch contributes nothing
        # autocast costs even when disabled: enter it only for mixed precision.
        with torch.autocast("cuda", dtype=dtype) if dtype else contextlib.nullcontext():
            part = loss_fn(model(xb), yb)
        if n != total_n.value:
            part = part * (n / total_n.value)
        (scaler.scale(part) if scaler is not None else part).backward()
        total = part.detach().float() if total is None else total + part.detach().float()
    return torch.zeros(()) if total is None else total


def _check_total(n: int) -> int:
    if n == 0:
        raise RunError(
            "train.step got an empty batch",
            hint="check `done` from `read` before training on its fields",
        )
    return n


def evaluate(
    ctx: OpContext, model: Any, reader: Reader, *, loss: str = "cross_entropy"
) -> tuple[float, float | None]:
    """`evaluate`: mean loss and accuracy over one full pass, reduced over ranks.

    Accuracy is computed when the labels are class indices (integers, or cross_entropy
    with one dimension less than the predictions); it is None otherwise (regression).
    """
    if not isinstance(reader, Reader):
        raise RunError(f"evaluate expects a reader, got a {type(reader).__name__}")
    if len(reader.fields) < 2:
        raise RunError("evaluate needs a reader over (x, y)", hint="reader: {in: [x, y]}")
    loss_fn = _loss_fn(loss)
    was_training = getattr(model, "training", False)
    if isinstance(model, nn.Module):
        model.eval()
    try:
        with torch.no_grad():
            sums = _eval_sums(ctx, model, loss_fn, loss, reader, _on_host(ctx))
    finally:
        if isinstance(model, nn.Module):
            model.train(was_training)
    loss_sum, count, correct, classified = _reduce_sums(ctx, sums)
    if count == 0:
        raise RunError("evaluate: the reader has no records", hint="check the eval data")
    # Accuracy per label: for sequence outputs every position is one prediction.
    return loss_sum / count, (correct / classified if classified > 0 else None)


def _on_host(ctx: OpContext) -> bool:
    return ctx.device == "cpu" or torch.device(ctx.device).type == "cpu"


def _eval_sums(ctx, model, loss_fn, loss: str, reader: Reader, host: bool) -> list[Any]:
    """[sum of loss * count, count, correct labels, labels compared] over one pass.

    Float64 sums, added batch by batch in order. On the CPU they are Python floats and
    ints (the same IEEE double arithmetic as float64 tensors, without three tensor ops
    per indexed in-place add); elsewhere 0-d device tensors, so that the loop never waits
    for the device.
    """
    loss_sum: Any = 0.0
    count = classified = 0
    correct: Any = 0
    for fields in reader.full_pass():
        x = _as_tensor(fields[0], ctx.device, "evaluate input x")
        y = _as_tensor(fields[1], ctx.device, "evaluate input y")
        n = _count(y)
        if n == 0:
            continue
        pred = model(x)
        part = loss_fn(pred, y)
        loss_sum = loss_sum + (part.item() if host else part.double()) * n
        count += n
        labels = not y.is_floating_point() or loss == "cross_entropy"
        if labels and pred.dim() == y.dim() + 1:
            hits = (pred.argmax(dim=-1) == (y if y.dtype == torch.long else y.long())).sum()
            correct = correct + (int(hits) if host else hits)
            classified += y.numel()
    return [loss_sum, count, correct, classified]


def _reduce_sums(ctx: OpContext, sums: list[Any]) -> list[float]:
    """The sums as floats, summed over ranks (one collective)."""
    if not ctx.distributed:
        return [float(v) for v in sums]
    dev = _comm_device(ctx)
    reduced = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(dev) for v in sums])
    torch.distributed.all_reduce(reduced)
    return reduced.tolist()


# --------------------------------------------------------------- export, distributed


def export(
    ctx: OpContext,
    model: nn.Module,
    example_input: Any,
    *,
    path: str = "model.pt2",
    dynamic_batch: bool = True,
) -> str:
    """`export`: model, example_input -> path of a torch.export program (eval mode).

    Rank 0 writes; the others wait for it, so the file exists when every rank goes on.
    """
    if not isinstance(model, nn.Module):
        raise RunError(f"export expects an nn.Module, got a {type(model).__name__}")
    out = ctx.resolve_write(path)
    if ctx.rank == 0:
        program = _export_program(ctx, model, example_input, dynamic_batch)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.export.save(program, out)
    if ctx.distributed:
        torch.distributed.barrier()
    return str(out)


def _export_program(ctx: OpContext, model: nn.Module, example: Any, dynamic_batch: bool):
    items = example if isinstance(example, list | tuple) else [example]
    args = tuple(_as_tensor(v, ctx.device, "export example_input") for v in items)
    # AUTO lets dim 0 vary, or specialises it silently (e.g. a batch of one).
    dims = tuple({0: torch.export.Dim.AUTO} if a.dim() > 0 else None for a in args)
    was_training = model.training
    model.eval()
    try:
        return torch.export.export(model, args, dynamic_shapes=dims if dynamic_batch else None)
    except Exception as e:
        raise RunError(
            f"export: torch.export failed: {type(e).__name__}: {e}",
            hint="the model's forward must be traceable; try dynamic_batch: false",
        ) from e
    finally:
        model.train(was_training)


_REDUCE_OPS = ("sum", "mean", "max", "min")


def dist_allreduce(ctx: OpContext, x: Any, *, op: str = "sum") -> Any:
    """`dist.allreduce`: x -> y over ranks (identity, up to `mean`, in one process)."""
    if op not in _REDUCE_OPS:
        raise RunError(f"dist.allreduce: unknown op {op!r}", hint=f"one of {_REDUCE_OPS}")
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        if ctx.distributed:
            t = y.to(_comm_device(ctx))
            torch.distributed.all_reduce(t, op=_reduce_op("sum" if op == "mean" else op))
            y = t.to(x.device)
        return y / ctx.world_size if op == "mean" else y
    if isinstance(x, bool | int | float | np.number):
        value: Any = int(x) if isinstance(x, bool | np.integer) else x
        if ctx.distributed:
            kind = torch.int64 if isinstance(value, int) else torch.float64
            t = torch.tensor([value], dtype=kind, device=_comm_device(ctx))
            torch.distributed.all_reduce(t, op=_reduce_op("sum" if op == "mean" else op))
            value = t.item()
        return value / ctx.world_size if op == "mean" else value
    raise RunError(f"dist.allreduce: cannot reduce a {type(x).__name__}; use tensors or numbers")


def _reduce_op(op: str) -> Any:
    ops = torch.distributed.ReduceOp
    return {"sum": ops.SUM, "max": ops.MAX, "min": ops.MIN}[op]


# Broadcast header: [kind, dtype code, ndim, dims...]; receivers need not know the shape.
_KINDS = {"unsupported": 0, "tensor": 1, "int": 2, "float": 3, "bool": 4}
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_MAX_DIMS = 8


def dist_broadcast(ctx: OpContext, x: Any, *, src: int = 0) -> Any:
    """`dist.broadcast`: x -> y, rank `src`'s value on every rank."""
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < ctx.world_size:
        raise RunError(f"dist.broadcast: src must be a rank in [0, {ctx.world_size}), got {src}")
    if not ctx.distributed:
        return x.detach().clone() if isinstance(x, torch.Tensor) else x
    dev = _comm_device(ctx)
    header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=dev)
    if ctx.rank == src:
        header.copy_(_broadcast_header(x))
    torch.distributed.broadcast(header, src=src)
    kind, code, ndim, *dims = header.tolist()
    if kind == _KINDS["unsupported"]:
        raise RunError(
            f"dist.broadcast: rank {src} holds a value that cannot be broadcast",
            hint="broadcast tensors (up to 8 dimensions, plain dtypes) or numbers",
        )
    if kind == _KINDS["tensor"]:
        payload = x.detach().to(dev).clone() if ctx.rank == src else None
        if payload is None:
            payload = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=dev)
        torch.distributed.broadcast(payload, src=src)
        return payload.to(ctx.device)
    dtype = torch.float64 if kind == _KINDS["float"] else torch.int64
    payload = torch.tensor([x if ctx.rank == src else 0], dtype=dtype, device=dev)
    torch.distributed.broadcast(payload, src=src)
    value = payload.item()
    return bool(value) if kind == _KINDS["bool"] else value


def _broadcast_header(x: Any) -> torch.Tensor:
    header = [0] * (3 + _MAX_DIMS)
    if isinstance(x, torch.Tensor) and x.dtype in _DTYPES and x.dim() <= _MAX_DIMS:
        header[:3] = [_KINDS["tensor"], _DTYPES.index(x.dtype), x.dim()]
        header[3 : 3 + x.dim()] = list(x.shape)
    elif isinstance(x, bool):
        header[0] = _KINDS["bool"]
    elif isinstance(x, int):
        header[0] = _KINDS["int"]
    elif isinstance(x, float):
        header[0] = _KINDS["float"]
    return torch.tensor(header, dtype=torch.int64)


def model_gather(ctx: OpContext, model: Any) -> dict[str, torch.Tensor] | None:
    """`model.gather`: a CPU copy of the full state dict on rank 0, None elsewhere.

    Data-parallel replicas hold identical full parameters, so no communication is
    needed; the op marks where a sharded strategy would gather.
    """
    if not isinstance(model, nn.Module):
        raise RunError(f"model.gather expects an nn.Module, got a {type(model).__name__}")
    if ctx.rank != 0:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
