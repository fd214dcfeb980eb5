"""Turn a workspace (blob name -> value) into JSON plus tensors, and back.

``encode`` splits the values into a JSON-able tree (``values.json``) and a flat dict of
tensors (``tensors.safetensors``); ``decode`` joins them again. No pickle: only the types
below are stored, anything else raises :class:`UnsupportedValue`.

* None, bool, int, str, finite floats: as JSON; nan and ±inf: tagged.
* list: a JSON list; tuple: tagged, so it decodes as a tuple.
* dict with str keys: a JSON object; other keys (the int keys of optimizer state):
  tagged, with each key encoded so it comes back with its type.
* torch.Tensor (any device; decoded on the CPU, the runner moves it) and numpy arrays
  (decoded as numpy): a reference to an entry of the tensor dict.
* numpy scalars (bool, int, float): tagged with their dtype.
* objects with ``state_dict()`` (modules, optimizers, schedulers, GradScaler, readers)
  and torch.Generator: tagged with the type name; decoded as :class:`SavedState`,
  which :func:`restore` loads into the live object. A module's modes and frozen
  parameters go with it (:mod:`jobrun.store.modules`).

Tags are JSON objects with a ``"__jobrun__"`` key; a user dict that has such a key is
stored tagged (as a list of pairs), so the two never mix.

Tensor keys are readable and unique: ``<blob>`` for a tensor blob, ``<blob>.<path>`` for
nested ones (``model.fc.weight``, ``optim.state.0.exp_avg``), with a ``~N`` suffix when
odd dict keys would make two of them equal.
"""

from __future__ import annotations

import base64
import math
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from jobrun.errors import CheckpointError
from jobrun.plans.scalars import show  # a file's values quoted short: an attacker's 70 kB name
from jobrun.store import shards
from jobrun.store.modules import apply_module_flags, module_flags

TAG = "__jobrun__"
_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_RESERVED_KEYS = {"__metadata__"}  # safetensors keeps this name for itself
# numpy scalar dtypes we store (bool, ints, floats of at most 8 bytes), as dtype.str.
_NP_SCALAR = re.compile(r"\|b1|[<>|][iu][1248]|[<>]f[248]")
# Array dtypes the safetensors format has (complex128 goes as float64 pairs, see tensor()).
_TORCH_DTYPES = frozenset({
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "bfloat16", "float32", "float64", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
})
_NUMPY_KINDS = frozenset({("b", 1), ("c", 8)} | {(k, n) for k in "iu" for n in (1, 2, 4, 8)}
                         | {("f", n) for n in (2, 4, 8)})


@dataclass(frozen=True)
class SavedState:
    """The saved ``state_dict()`` of a live object (or a torch.Generator's state).

    ``type_name`` is :func:`type_name_of` of the object that was saved; ``state`` is the
    decoded state dict (a uint8 tensor for a generator). Load it with :func:`restore`.
    """

    type_name: str
    state: Any
    module: dict[str, Any] | None = None  # a module's modes and frozen parameters


class UnsupportedValue(CheckpointError):
    """A workspace value that cannot be checkpointed (the runner warns and skips it)."""

    def __init__(self, blob: str, value_type: type | str, where: str = "") -> None:
        self.blob = blob
        self.type_name = value_type if isinstance(value_type, str) else _qualname(value_type)
        self.where = where or blob
        at = f" (at {self.where})" if self.where != blob else ""
        super().__init__(
            f"blob {blob!r}: cannot checkpoint a value of type {self.type_name}{at}",
            hint="checkpoints hold tensors, arrays, plain data and objects with state_dict(); "
            "this blob is not saved and will be recomputed or lost on resume",
        )


def _qualname(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def type_name_of(obj: Any) -> str:
    """The name a SavedState records for ``obj``'s type ("torch.nn.modules.linear.Linear")."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Generator):
        return "torch.Generator"  # its class lives in torch._C
    t = type(obj)
    if t.__module__.startswith("torch.distributed.") and len(t.__bases__) > 1:
        # replicate() and fully_shard() give a module the class `DDP<Cls>` / `FSDP<Cls>`
        # (their mixin, then its own): the user's class is the one to name
        t = next((b for b in t.__bases__ if not b.__module__.startswith("torch.distributed.")), t)
    return _qualname(t)


def restore(live: Any, saved: SavedState) -> None:
    """Load ``saved`` into ``live``: ``load_state_dict``, or ``set_state`` for a generator."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(live, torch.Generator):
        # set_state ignores a tensor's storage offset: hand it a tensor of its own.
        live.set_state(saved.state.clone())
        return
    load = getattr(live, "load_state_dict", None)
    if not callable(load):
        raise CheckpointError(
            f"cannot restore saved {saved.type_name} state into a {type_name_of(live)}",
            hint="the object has no load_state_dict(); did the plan change since the save?",
        )
    load(shards.relive(saved.state, live))  # a sharded model's parts back on its mesh
    if saved.module is not None:
        apply_module_flags(live, saved.module, saved.type_name)


# ---------------------------------------------------------------------------- encoding


def _is_key(k: Any) -> bool:
    """Keys we can store: they must decode to something hashable and equal."""
    if k is None or isinstance(k, bool | int | float | str):
        return True
    if isinstance(k, np.generic):
        return bool(_NP_SCALAR.fullmatch(k.dtype.str))
    return isinstance(k, tuple) and all(_is_key(x) for x in k)


def _cpu_tensor(t: Any, copy: bool, into: Any) -> Any:
    """A contiguous CPU tensor with t's values; never t's own memory when ``copy``.

    ``into``, the tensor of an earlier copy, is filled instead of new memory when it has
    t's dtype and shape: new memory costs a page fault per 4 KiB, often more than the copy.
    """
    import torch

    t = t.detach().resolve_conj().resolve_neg()
    if copy and _fits(into, t):
        return into.copy_(t)
    if t.device.type != "cpu":
        return t.to("cpu", memory_format=torch.contiguous_format)  # already a copy
    if copy:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def _fits(into: Any, t: Any) -> bool:
    torch = sys.modules["torch"]
    return (
        type(into) is torch.Tensor
        and into.device.type == "cpu"
        and into.dtype == t.dtype
        and into.shape == t.shape
        and into.is_contiguous()
    )


class _Encoder:
    """Encodes one blob; its tensors are merged only if the whole blob encodes."""

    def __init__(
        self,
        blob: str,
        used: set[str],
        copy: bool,
        reuse: Mapping[str, Any] | None,
    ) -> None:
        self.blob = blob
        self.used = used
        self.copy = copy
        self.reuse = reuse or {}
        self.tensors: dict[str, Any] = {}
        self._active: set[int] = set()  # containers being encoded: a repeat is a cycle

    def unsupported(self, value: Any, where: str, what: str | None = None) -> NoReturn:
        raise UnsupportedValue(self.blob, what or type(value), where)

    def claim(self, path: str) -> str:
        """A tensor key for ``path``, unique in the whole workspace."""
        key = path
        n = 0
        while key in self.used or key in _RESERVED_KEYS:
            n += 1
            key = f"{path}~{n}"
        self.used.add(key)
        return key

    @contextmanager
    def entering(self, container: Any, path: str) -> Iterator[None]:
        if id(container) in self._active:
            self.unsupported(container, path, f"self-containing {type(container).__name__}")
        self._active.add(id(container))
        try:
            yield
        finally:
            self._active.discard(id(container))

    def value(self, v: Any, path: str) -> Any:
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, np.generic) and _NP_SCALAR.fullmatch(v.dtype.str):
            return {TAG: "np_scalar", "dtype": v.dtype.str, "v": self.value(v.item(), path)}
        if isinstance(v, int):
            return int(v)  # an IntEnum or other subclass is stored as its value
        if isinstance(v, float):
            v = float(v)
            return v if math.isfinite(v) else {TAG: "float", "v": repr(v)}
        if isinstance(v, str):
            return str(v)
        if isinstance(v, bytes):
            return {TAG: "bytes", "b64": base64.b64encode(v).decode("ascii")}
        torch = sys.modules.get("torch")  # no torch object exists before torch is imported
        if torch is not None and isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if torch is not None and isinstance(v, torch.Generator):
            return {
                TAG: "state",
                "type": "torch.Generator",
                "state": self.value(v.get_state(), path),
            }
        if type(v) is np.ndarray:
            return self.ndarray(v, path)
        if isinstance(v, list | tuple | dict):
            with self.entering(v, path):
                return self.container(v, path)
        if not isinstance(v, type) and callable(getattr(v, "state_dict", None)):
            with self.entering(v, path):
                state = self.value(v.state_dict(), path)
            out = {TAG: "state", "type": type_name_of(v), "state": state}
            flags = module_flags(v)
            if flags is not None:
                out["module"] = flags
            return out
        self.unsupported(v, path)

    def container(self, v: list | tuple | dict, path: str) -> Any:
        if isinstance(v, list):
            return [self.value(x, f"{path}.{i}") for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {TAG: "tuple", "items": [self.value(x, f"{path}.{i}") for i, x in enumerate(v)]}
        meta = getattr(v, "_metadata", None)
        if isinstance(v, OrderedDict) and meta is not None:
            # nn.Module.state_dict() keeps per-module versions here for load_state_dict.
            items = self.mapping(v, path)
            return {TAG: "odict", "items": items, "meta": self.value(meta, f"{path}._metadata")}
        return self.mapping(v, path)

    def mapping(self, v: dict, path: str) -> Any:
        if all(type(k) is str for k in v) and TAG not in v:
            return {k: self.value(x, f"{path}.{k}") for k, x in v.items()}
        items = []
        for k, x in v.items():
            if not _is_key(k):
                self.unsupported(k, path, f"dict key of type {type(k).__name__}")
            items.append([self.value(k, path), self.value(x, f"{path}.{k}")])
        return {TAG: "dict", "items": items}

    def tensor(self, t: Any, path: str) -> dict[str, Any]:
        import torch

        if shards.is_dtensor(t):  # this rank's shard, and how the whole is split
            return {**self.tensor(t.to_local(), path), "shard": shards.facts(t)}
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            self.unsupported(t, path, f"torch.Tensor ({t.layout}, {t.dtype}, {t.device.type})")
        out: dict[str, Any] = {TAG: "tensor"}
        data = t.detach()
        if data.is_complex() and data.dtype != torch.complex64:
            # safetensors has only C64: store (real, imag) pairs in a trailing dimension.
            data = torch.view_as_real(data.resolve_conj())
            out["complex"] = True
        if str(data.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
            self.unsupported(t, path, f"torch.Tensor of dtype {t.dtype}")
        if isinstance(t, torch.nn.Parameter):
            out["param"] = True
        if t.requires_grad:
            out["grad"] = True
        if t.device.type != "cpu":
            out["device"] = str(t.device)  # for information: decode gives a CPU tensor
        key = out["key"] = self.claim(path)
        self.tensors[key] = _cpu_tensor(data, self.copy, self.reuse.get(key))
        return out

    def ndarray(self, a: np.ndarray, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {TAG: "ndarray"}
        if a.dtype.kind == "c" and a.dtype.itemsize == 16:
            a = np.ascontiguousarray(a).view(a.real.dtype).reshape(*a.shape, 2)
            out["complex"] = True
        if (a.dtype.kind, a.dtype.itemsize) not in _NUMPY_KINDS or a.dtype.fields is not None:
            self.unsupported(a, path, f"numpy.ndarray of dtype {a.dtype}")
        key = out["key"] = self.claim(path)
        into = self.reuse.get(key)
        native = a.dtype.newbyteorder("=")  # torch, which the file is written through, needs it
        if self.copy and type(into) is np.ndarray and into.dtype == native and into.shape == a.shape:
            np.copyto(into, a)
            a = into
        elif self.copy or not a.flags.c_contiguous or a.dtype != native:
            a = np.array(a, dtype=native, order="C")
        self.tensors[key] = a
        return out


def _check_blob_name(name: Any) -> None:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"bad blob name {name!r}: a non-empty str without '.' is needed")


def encode(
    blobs: dict[str, Any],
    *,
    copy: bool = False,
    reuse: Mapping[str, Any] | None = None,
    on_unsupported: Callable[[UnsupportedValue], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a workspace into (JSON-able tree, tensor key -> CPU tensor or numpy array).

    The tensors are contiguous CPU tensors; with ``copy=False`` a contiguous CPU tensor
    is returned as is (it shares memory with the workspace), with ``copy=True`` every
    tensor and array is a private copy that training may go on mutating; ``reuse`` (the
    tensors of an earlier ``copy=True`` encoding, no longer in use) lends its memory to
    the copies whose key, dtype and shape match. A blob that cannot be stored raises UnsupportedValue, or, when ``on_unsupported`` is given, is
    passed to it and left out.
    """
    tree: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    used: set[str] = set()
    for name, value in blobs.items():
        _check_blob_name(name)
        enc = _Encoder(name, used, copy, reuse)
        try:
            tree[name] = enc.value(value, name)
        except UnsupportedValue as e:
            if on_unsupported is None:
                raise
            on_unsupported(e)
            continue
        tensors.update(enc.tensors)
    return tree, tensors


# ---------------------------------------------------------------------------- decoding


def _bad(what: str) -> NoReturn:
    raise CheckpointError(
        f"values.json is malformed: {what}",
        hint="the checkpoint is corrupt or was written by a newer jobrun",
    )


class _Decoder:
    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def value(self, v: Any) -> Any:
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if not isinstance(v, dict):
            _bad(f"unexpected {type(v).__name__}")
        if TAG not in v:
            return {k: self.value(x) for k, x in v.items()}
        return self.tagged(v)

    def tagged(self, v: dict[str, Any]) -> Any:
        tag = v[TAG]
        if tag == "float":
            if v.get("v") not in _SPECIAL_FLOATS:
                _bad(f"bad special float {show(v.get('v'))}")
            return _SPECIAL_FLOATS[v["v"]]
        if tag == "tuple":
            return tuple(self.items(v))
        if tag == "dict":
            return self.pairs(v)
        if tag == "odict":
            out = OrderedDict(self.value(v["items"]))
            out._metadata = self.value(v["meta"])  # type: ignore[attr-defined]
            return out
        if tag == "bytes":
            return base64.b64decode(v["b64"], validate=True)
        if tag == "np_scalar":
            return self.np_scalar(v)
        if tag == "tensor":
            return self.tensor(v)
        if tag == "ndarray":
            return self.ndarray(v)
        if tag == "state":
            if not isinstance(v.get("type"), str):
                _bad("a saved state without a type name")
            state = self.value(v["state"])
            if v["type"] == "torch.Generator" and not isinstance(state, np.ndarray):
                # Generator.set_state ignores storage offsets (small tensors are views
                # into a shared buffer), so give the state memory of its own.
                state = state.clone()
            return SavedState(v["type"], state, v.get("module"))
        _bad(f"unknown tag {show(tag)}")

    def items(self, v: dict[str, Any]) -> list[Any]:
        items = v["items"]
        if not isinstance(items, list):
            _bad(f"{v[TAG]} items must be a list")
        return [self.value(x) for x in items]

    def pairs(self, v: dict[str, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for pair in v["items"]:
            if not (isinstance(pair, list) and len(pair) == 2):
                _bad("dict items must be [key, value] pairs")
            key = self.value(pair[0])
            if not _is_key(key):
                _bad(f"unusable dict key {show(key)}")
            out[key] = self.value(pair[1])
        return out

    def np_scalar(self, v: dict[str, Any]) -> np.generic:
        code = v["dtype"]
        if not isinstance(code, str) or not _NP_SCALAR.fullmatch(code):
            _bad(f"bad numpy scalar dtype {show(code)}")
        return np.dtype(code).type(self.value(v["v"]))

    def lookup(self, v: dict[str, Any]) -> Any:
        key = v.get("key")
        if not isinstance(key, str) or key not in self.tensors:
            raise CheckpointError(
                f"tensor {show(key)} named in values.json is missing from tensors.safetensors",
                hint="the checkpoint is corrupt; resume from another epoch",
            )
        return self.tensors[key]

    def tensor(self, v: dict[str, Any]) -> Any:
        if "shard" in v:
            return shards.saved(self.tensor({k: x for k, x in v.items() if k != "shard"}), v["shard"])
        t = self.lookup(v)
        if isinstance(t, np.ndarray):  # as_numpy: no torch, no Parameter
            return _numpy_complex(t) if v.get("complex") else t
        import torch

        if v.get("complex"):
            # view_as_complex needs an even element offset; a copy fixes an odd one.
            t = torch.view_as_complex(t if t.storage_offset() % 2 == 0 else t.clone())
        if v.get("param"):
            return torch.nn.Parameter(t, requires_grad=bool(v.get("grad")))
        if v.get("grad"):
            t.requires_grad_(True)
        return t

    def ndarray(self, v: dict[str, Any]) -> np.ndarray:
        t = self.lookup(v)
        a = t if isinstance(t, np.ndarray) else t.numpy()
        return _numpy_complex(a) if v.get("complex") else a


def _numpy_complex(a: np.ndarray) -> np.ndarray:
    """(real, imag) pairs in the last dimension as a complex array, when numpy has one."""
    kinds = {np.dtype("<f4"): np.complex64, np.dtype("<f8"): np.complex128}
    if a.dtype not in kinds or a.ndim == 0 or a.shape[-1] != 2:
        return a
    return np.ascontiguousarray(a).view(kinds[a.dtype])[..., 0]


def decode(tree: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The workspace that ``encode`` split into ``tree`` and ``tensors``.

    Torch tensors come back as the CPU tensors of ``tensors`` themselves (no copy; the
    runner moves them to their device). When ``tensors`` holds numpy arrays (read with
    ``as_numpy=True``) every tensor comes back as a numpy array and torch is never
    imported. Objects with a state come back as SavedState (see :func:`restore`).
    """
    if not isinstance(tree, dict):
        _bad("the blobs are not a JSON object")
    dec = _Decoder(tensors)
    try:
        return {name: dec.value(v) for name, v in tree.items()}
    except (KeyError, TypeError, ValueError, RuntimeError, RecursionError, OverflowError) as e:
        _bad(f"{type(e).__name__}: {e}")
