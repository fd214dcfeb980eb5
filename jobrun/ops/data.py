"""The data ops: `data.synthetic` and `data.load` with its file readers.

Data is made and read as CPU tensors; readers (:mod:`jobrun.ops.reader`) move batches to
the device. No reader unpickles: ``.npy``/``.npz`` refuse object arrays, ``.pt`` loads
with ``weights_only=True``.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobrun.errors import RunError, did_you_mean
from jobrun.ops.context import OpContext
from jobrun.ops.train_specs import RAW_DTYPES
from jobrun.plans.analyze_data import load_problem


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
    require_int("data.synthetic", "n", n, 1)
    require_int("data.synthetic", "features", features, 1)
    if noise < 0:
        raise RunError(f"data.synthetic: noise must be >= 0, got {noise}")
    gen = torch.Generator().manual_seed(int(seed))
    if task == "classification":
        if classes is None:
            raise RunError("data.synthetic: classification needs `classes`", hint="classes: 3")
        require_int("data.synthetic", "classes", classes, 2)
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
    dtype: str | None = None,
    mmap: bool | None = None,
) -> Any:
    """Arrays from a file, as CPU tensors, one output per array (see train_specs).

    A raw `.bin` file (a token stream, as nanoGPT's prepare.py writes) is a 1-D array of
    `dtype`; it and a `.npy` file are memory-mapped (`mmap`; null: a `.bin` always, a
    `.npy` from MMAP_BYTES on): the tensor reads the file's pages as they are touched, and
    copy-on-write keeps a write into it from reaching the file. Made in `init`, such a
    tensor is not in checkpoints (what init builds is not: plans/state.py); resume maps
    the file again, and the fingerprint of init's products checks it did not change.
    """
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
    problem = load_problem(file.name, dtype, columns, mmap)  # analyze refuses the same, earlier
    if problem is not None:
        raise RunError(problem[0], hint=problem[1])
    if suffix == ".bin":
        values = [_load_raw(file, dtype, mmap)]  # type: ignore[arg-type]
    elif suffix == ".npz":
        values = _load_npz(file, keys)
    elif suffix == ".npy":
        mapped = mmap if mmap is not None else file.stat().st_size >= MMAP_BYTES
        values = [_np_load(file, "c" if mapped else None)]
    elif suffix == ".csv":
        values = _load_csv(file, columns, header, delimiter)
    elif suffix == ".safetensors":
        tensors = _load_safetensors(file)
        if keys is None and len(tensors) > 1:  # the format keeps no order: never guess one
            raise RunError(f"data.load: {file.name!r} holds {len(tensors)} tensors "
                           f"({', '.join(sorted(tensors))}), and a safetensors file keeps no order",
                           hint=f"name them in the order of `out` with `keys: [{', '.join(sorted(tensors))}]`")
        values = _pick(tensors, keys, file)
    elif suffix == ".pt":
        values = _load_pt(file, keys)
    else:
        raise AssertionError(suffix)  # load_problem refuses every other suffix
    tensors = [_to_torch(v, float_dtype, file) for v in values]
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


MMAP_BYTES = 64 << 20  # a .npy file this large is memory-mapped unless `mmap: false`


def _load_raw(file: Path, dtype: str, mmap: bool | None) -> Any:
    """A raw file as a 1-D array of `dtype`: memory-mapped copy-on-write (unless mmap: false)."""
    if dtype not in RAW_DTYPES:
        raise RunError(f"data.load: unknown dtype {dtype!r}", hint=did_you_mean(dtype, RAW_DTYPES)
                       or f"one of {', '.join(RAW_DTYPES)}")
    item = np.dtype(dtype).itemsize
    size = file.stat().st_size
    if size % item:
        raise RunError(f"data.load: {file.name!r} has {size} bytes, not a whole number of {dtype} "
                       f"values ({item} bytes each)", hint="check the dtype the file was written with")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    if mmap is False:
        return np.fromfile(file, dtype=dtype)
    return np.memmap(file, dtype=dtype, mode="c")


def _np_load(file: Path, mmap_mode: str | None = None) -> Any:
    try:
        return np.load(file, allow_pickle=False, mmap_mode=mmap_mode)
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
        value = torch.from_numpy(np.require(value, requirements="C"))
    if not isinstance(value, torch.Tensor):
        raise RunError(f"data.load: {file.name!r} holds a {type(value).__name__}, not a tensor")
    if float_dtype is not None and value.is_floating_point():
        value = value.to(_FLOAT_DTYPES[float_dtype])
    return value


# -- shared by the ops that take batches ----------------------------------------------


def as_tensor(value: Any, device: torch.device | str, what: str) -> torch.Tensor:
    """`value` as a tensor on `device`; a null field of a finished `read` is an error."""
    if isinstance(value, torch.Tensor):
        # `.to` costs a dispatch even when it does nothing: skip it on the CPU hot path.
        if device == "cpu" and value.is_cpu:
            return value
        return value.to(device)
    if value is None:
        from jobrun.ops.core import NULL_HINT

        raise RunError(f"{what} is null (None)", hint=NULL_HINT)
    try:
        return torch.as_tensor(np.asarray(value)).to(device)
    except Exception as e:
        raise RunError(f"{what} cannot be made a tensor: {type(value).__name__}") from e


def require_int(op: str, name: str, value: Any, minimum: int) -> None:
    """An argument that must be an int >= `minimum` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RunError(f"{op}: {name} must be an integer >= {minimum}, got {value!r}")
