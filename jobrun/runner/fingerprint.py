"""A fingerprint of what `init` built and checkpoints do not hold, to check a resume.

Checkpoints hold what steps after `init` change (:mod:`jobrun.plans.state`); resume runs
`init` again for the rest: data, data sets, constants. That is exact only if `init`
builds the same things again, which a changed data file or changed code breaks. So every
checkpoint records, per blob it does not hold, a short description::

    tensor / array    shape, dtype and a CRC-32 of its bytes: all of them up to 64 MiB,
                      beyond that 64 evenly spaced pieces of 1 MiB (a changed file of
                      that size changes most pieces; reading it whole would cost seconds)
    module, object    with a state_dict: a CRC-32 of the state's tensors and values
    number, string    its value (a long string: its length and CRC-32)
    list, dict        a CRC-32 over their items
    anything else     its type, and its length when it has one (a Dataset: its size)

and the random state `init` left (a CRC-32 of each stream), and resume compares them
once `init` has run again (:func:`changes`). A random stream that is still where `init`
left it when a checkpoint is saved is not stored but listed (:func:`rng_to_save`): resume
runs `init`, which leaves it there again (the fingerprint checks it).
"""

from __future__ import annotations

import contextlib
import math
import sys
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobrun.errors import Pos
    from jobrun.plans import ir

RNG_PARTS = ("python", "numpy", "torch", "node", "cuda")  # a node's random streams
FULL = 64 << 20  # bytes of a tensor checksummed whole
PIECES, PIECE = 64, 1 << 20  # beyond FULL: this many pieces of this many bytes


def fingerprint(blobs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Blob name -> a JSON-able description (see the module docstring)."""
    return {name: describe(value) for name, value in blobs.items()}


def describe(value: Any) -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if value is None or isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
        return {"value": value}
    if isinstance(value, str):
        return {"value": value} if len(value) <= 200 else {"str": len(value), "crc": _crc(value.encode())}
    if torch is not None and isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "crc": _tensor_crc(value)}
    if type(value).__module__ == "numpy" and hasattr(value, "dtype") and hasattr(value, "shape"):
        return {"array": list(value.shape), "dtype": str(value.dtype), "crc": _tensor_crc(value)}
    digest = _Digest()
    if isinstance(value, list | tuple | dict | float):
        digest.add(value)
        return {"type": type(value).__name__, "crc": digest.hex()}
    if not isinstance(value, type) and callable(getattr(value, "state_dict", None)):
        digest.add(value.state_dict())
        return {"type": _type_name(value), "crc": digest.hex()}
    out: dict[str, Any] = {"type": _type_name(value)}
    with contextlib.suppress(Exception):  # no length, or a broken __len__: the type must do
        out["len"] = len(value)
    return out


def of_init(unsaved: dict[str, Any], rng_key: str, rng: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The fingerprint a checkpoint records: the blobs it does not hold, and under
    `rng_key` the random streams as `init` left them."""
    out = fingerprint(unsaved)
    out[rng_key] = {part: describe(v) for part, v in rng.items() if part in RNG_PARTS}
    return out


def changes(saved: Any, now: dict[str, Any], rng_key: str) -> list[str]:
    """What differs between a checkpoint's fingerprint (`saved`, from `of_init`) and
    `now`'s, one line a blob and one for the random streams; nothing for a checkpoint
    written before fingerprints were."""
    if not isinstance(saved, dict):
        return []
    lines = differences({k: v for k, v in saved.items() if k != rng_key}, now)
    streams = saved.get(rng_key) if isinstance(saved.get(rng_key), dict) else {}
    drawn = [p for p, d in streams.items() if now.get(rng_key, {}).get(p) != d]
    if drawn:
        lines.append(f"the random state init leaves ({', '.join(drawn)}) is another: it draws "
                     "other random numbers")
    return lines


def rng_to_save(state: dict[str, Any], after_init: dict[str, Any] | None) -> dict[str, Any]:
    """The random state to save: a stream still where init left it is listed under
    "unchanged", not stored. A plan that draws no random numbers after init (no
    dropout, no random transforms in this process) stores no stream at all."""
    if after_init is None:
        return state
    same = [p for p in RNG_PARTS if p in state and p in after_init and _same(state[p], after_init[p])]
    return {**{k: v for k, v in state.items() if k not in same}, "unchanged": same}


def _same(a: Any, b: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs, one line per blob of `saved` (blobs new since then are not compared)."""
    lines = []
    for name, was in saved.items():
        if name not in now:
            lines.append(f"blob {name!r}: init built it when the run started, not now")
        elif now[name] != was:
            lines.append(f"blob {name!r}: {_text(was)} when the run started, now {_text(now[name])}")
    return lines


def _text(d: Any) -> str:
    if not isinstance(d, dict):
        return repr(d)
    if "tensor" in d or "array" in d:
        shape = d.get("tensor", d.get("array"))
        return f"{d.get('dtype')} {shape} with CRC-32 {d.get('crc')}"
    if "value" in d:
        return f"the value {d['value']!r}"
    return ", ".join(f"{k} {v}" for k, v in d.items())


def _type_name(value: Any) -> str:
    """The class of `value` as the user's code made it: DDP (``replicate``) and FSDP
    (``fully_shard``) give a module a class of their own, ``DDPSequential(DDP,
    Sequential)``, which one replica never does."""
    t = type(value)
    while t.__module__.startswith("torch.distributed.") and len(t.__bases__) > 1:
        t = t.__bases__[-1]
    return f"{t.__module__}.{t.__qualname__}"


def _crc(data: Any, crc: int = 0) -> int:
    return zlib.crc32(memoryview(data).cast("B"), crc)


def _tensor_crc(t: Any) -> str:
    """CRC-32 of a tensor's or array's bytes: whole up to FULL, else PIECES pieces."""
    data = _bytes_view(t)
    n = len(data)
    if n <= FULL:
        return f"{_crc(data):08x}"
    crc = 0
    step = (n - PIECE) / (PIECES - 1)
    for k in range(PIECES):
        start = int(k * step)
        crc = _crc(data[start : start + PIECE], crc)
    return f"{crc:08x}~"  # the mark: sampled


def _bytes_view(t: Any) -> memoryview:
    """The bytes of a tensor (copied to the host when elsewhere) or an array, flat."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        t = t.detach()
        sharded = sys.modules.get("torch.distributed.tensor")
        if sharded is not None and isinstance(t, sharded.DTensor):
            # A model `parallel: fsdp` sharded (a frozen teacher init loads): the whole
            # tensor, gathered from every rank (each fingerprints the same blobs in the
            # same order), so it is the model's whatever the number of replicas.
            t = t.full_tensor()
        if t.device.type != "cpu":
            t = t.cpu()
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    import numpy as np

    return memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))


class _Digest:
    """A CRC-32 over nested values (a state dict): structure, keys, numbers and tensors."""

    def __init__(self) -> None:
        self.crc = 0

    def feed(self, data: bytes | memoryview) -> None:
        self.crc = _crc(data, self.crc)

    def add(self, value: Any) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            self.feed(f"T{list(value.shape)}{value.dtype}".encode())
            self.feed(_tensor_crc(value).encode())
        elif isinstance(value, dict):
            self.feed(b"{")
            for k, v in value.items():
                self.feed(repr(k).encode())
                self.add(v)
            self.feed(b"}")
        elif isinstance(value, list | tuple):
            self.feed(b"[")
            for v in value:
                self.add(v)
            self.feed(b"]")
        elif type(value).__module__ == "numpy" and hasattr(value, "shape"):
            self.feed(_tensor_crc(value).encode())
        else:
            self.feed(repr(value).encode())

    def hex(self) -> str:
        return f"{self.crc:08x}"


# -- ranks that must agree -------------------------------------------------------------------


def of_data(blobs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The fingerprint of the data `init` built (tensors, arrays, numbers, strings, lists,
    dicts), which every rank of a data-parallel job must build alike: objects with a
    state (models, optimizers, readers) are left out, as a sharded model differs per
    rank by design."""
    torch = sys.modules.get("torch")
    plain = (type(None), bool, int, float, str, list, tuple, dict)
    return {name: describe(v) for name, v in blobs.items()
            if isinstance(v, plain) or (torch is not None and isinstance(v, torch.Tensor)
                                        and not _is_dtensor(v))
            or (type(v).__module__ == "numpy" and hasattr(v, "shape"))}


def _is_dtensor(t: Any) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def check_ranks(nodes: dict[str, dict[str, Any]], init: ir.Group | None = None) -> None:
    """Every rank's init must have built the same data (``nodes``: this rank's blobs that
    checkpoints do not hold, per node): hosts whose data files differ, with the same
    shapes, trained together without a word. Compared once, after init; every rank gets
    every fingerprint, so all stop together (a RunError naming the ranks and hosts, at
    the step of ``init`` that last wrote the first blob that differs)."""
    import socket

    from jobrun.errors import RunError
    from jobrun.runner.group import gather

    mine = {"host": socket.gethostname(), "nodes": {name: of_data(blobs) for name, blobs in nodes.items()}}
    differ = rank_differences(gather(mine))
    if differ:
        lines = [line for _, _, line in differ]
        error = RunError(
            "the ranks' init built different data, so they would train on different things: "
            + "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else ""),
            _written_at(init, *differ[0][:2]),
            hint="every host must read the same files (copy them from one host), and init must not "
                 "depend on the rank: each rank's part of the data is what `reader` gives it, or what "
                 "a `call` in an epoch task cuts with its `rank` and `world_size`")
        error.every_rank = True  # every rank has every fingerprint: the job fails, no rank does
        raise error


def _written_at(init: ir.Group | None, node: str, name: str) -> Pos | None:
    """The last step of `init` on `node` that writes blob `name`, if one does."""
    from jobrun.plans.visit import task_calls

    found = None
    for task in init.tasks if init is not None else ():
        for call in task_calls(task) if task.node == node else ():
            if any(out.name == name for out in call.outs):
                found = call.pos
    return found


def rank_differences(gathered: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """What the ranks' init built differently, as (node, blob, a line that says it), one per
    blob and rank (``gathered``: every rank's {"host": ..., "nodes": {node: of_data(...)}},
    in rank order); [] when alike."""
    first = gathered[0]
    lines = []
    for rank, theirs in enumerate(gathered[1:], 1):
        for node, blobs in first["nodes"].items():
            other = theirs["nodes"].get(node, {})
            for name in sorted(set(blobs) | set(other)):
                if blobs.get(name) != other.get(name):
                    lines.append((node, name, (
                        f"blob {name!r} of node {node!r}: rank 0 (host {first['host']}) built "
                        f"{_built(blobs.get(name))}, rank {rank} (host {theirs['host']}) "
                        f"{_built(other.get(name))}")))
    return lines


def _built(d: Any) -> str:
    return "nothing" if d is None else _text(d)
