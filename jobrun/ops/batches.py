"""How many records a batch holds: one rule for `train.step` and `evaluate` (the loss's
weight), the readers that split a collated batch over replicas, and the throughput feed
(samples/s, tokens/s).

A field's records are its first dimension (a tensor or an array; a 0-d one is one
record), a list's or tuple's length (a collated list of strings), else one. A dict batch
(any mapping: a DataLoader's collate, a reader with `keys`, Hugging Face's BatchEncoding)
is counted by its first batched value (:func:`counter`): a tensor whose first dimension
runs over the records. So ``{"text": [...], "input_ids": ids}`` counts ``len(ids)``, and
a 0-d value beside batched ones (a flag, a temperature) counts nothing. Without torch
(the throughput feed imports it where commands must not import torch): a tensor is
anything with a ``shape``.

Tokens (tokens/s): a batch whose counting value is an integer (batch, sequence) tensor or
array (token ids) holds records x sequence tokens; any other batch holds none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def counter(batch: Mapping[Any, Any]) -> Any:
    """The value that counts a dict batch's records: its first tensor or array with a
    dimension; without one its first tensor (a single record, unbatched), else its first
    value (None when it is empty)."""
    unbatched = None
    for value in batch.values():
        shape = getattr(value, "shape", None)
        if shape:  # a shape with a dimension: batched
            return value
        if shape is not None and unbatched is None:
            unbatched = (value,)
    return unbatched[0] if unbatched else next(iter(batch.values()), None)


def records(value: Any) -> int:
    """The records of one field of a batch (see the module's rule); 0 for an empty
    mapping."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    if isinstance(value, Mapping):
        return records(counter(value)) if value else 0
    return len(value) if isinstance(value, list | tuple) else 1


def counts(batch: tuple[Any, ...]) -> tuple[int, int]:
    """(records, tokens) of a batch's fields (see the module's rule): its first field
    counts, a dict batch by its :func:`counter`."""
    x = batch[0] if batch else None
    if isinstance(x, Mapping):
        x = counter(x)
        if x is None:  # an empty mapping
            return 0, 0
    n = records(x)
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) == 2 and holds_ints(x):
        return n, n * int(shape[1])
    return n, 0


def holds_ints(x: Any) -> bool:
    """Whether x holds integers (torch's or numpy's), by a dict lookup of its dtype (learnt
    as seen: getattr(dtype, "kind", "") of a torch dtype raised and caught an
    AttributeError each time)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    known = _INT_DTYPES.get(dtype)
    if known is None:
        known = _INT_DTYPES[dtype] = _ints(dtype)
    return known


_INT_DTYPES: dict[Any, bool] = {}  # dtype -> whether it holds integers


def _ints(dtype: Any) -> bool:
    if type(dtype).__module__ == "torch":  # without importing torch: commands must not
        import torch

        return dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                         torch.uint16, torch.uint32, torch.uint64)
    kind = getattr(dtype, "kind", "")  # numpy's: "i" signed, "u" unsigned
    return kind in ("i", "u")
