"""How a global batch splits over replicas: each rank's rows of it, and the tag that
tells `train.step` the records of the whole batch (every rank knows them from the split,
so no collective counts them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def rank_bounds(length: int, rank: int, world: int) -> tuple[int, int]:
    """This rank's [lo, hi) of a batch of `length`, like torch.tensor_split."""
    base, extra = divmod(length, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


_RECORDS = "_jobrun_records"


def mark_records(fields: tuple[Any, ...], records: int) -> tuple[Any, ...]:
    """Tag the tensors of a rank's part of a global batch with the records of the whole
    batch (all ranks together): every rank knows them from the split, so `train.step`
    weights its loss by its share without a collective to count them. A dict batch's
    tensors are tagged each (train.step reads the tag of the one that counts its records,
    see :mod:`jobrun.ops.batches`)."""
    for f in fields:
        for t in f.values() if f.__class__ is not torch.Tensor and isinstance(f, Mapping) else (f,):
            if isinstance(t, torch.Tensor):
                setattr(t, _RECORDS, records)
    return fields


def global_records(t: Any) -> int | None:
    """The records of the global batch a tensor is a rank's part of (see
    :func:`mark_records`); None for a tensor a reader did not split."""
    return getattr(t, _RECORDS, None)
