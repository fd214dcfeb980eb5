"""jobrun: run PyTorch training jobs described by declarative YAML plans.

For your own code (a `call`'s function): :func:`batch_rows`; for a hand loop that draws
what a plan draws: :func:`node_seed`, and reads in a shuffled reader's order: :func:`reader_order`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def batch_rows(batch: Any) -> tuple[int, slice]:
    """The records of the global batch that `batch` (a tensor a `read` handed out) is
    this replica's part of, and the rows of it this replica holds: ``(total, rows)``.

    With replicas, each one reads a part of every global batch. Randomness drawn for
    the whole global batch from the `generator` a `call` receives (the same stream on
    every replica), then cut to ``rows``, is what one process draws for those records,
    so N replicas train as one does::

        total, rows = batch_rows(real)
        z = torch.randn(total, noise, generator=generator)[rows].to(real.device)

    With one process, or for a tensor that no reader split (a `batch_size: 1` reader's,
    which every replica reads whole, or one computed from a batch), it is
    ``(len(batch), slice(0, len(batch)))``.
    """
    from jobrun.ops.split import global_records, rank_bounds

    total = global_records(batch)
    if total is None:
        return len(batch), slice(0, len(batch))
    import torch.distributed as dist

    lo, hi = rank_bounds(total, dist.get_rank(), dist.get_world_size())
    if hi - lo != len(batch):
        raise ValueError(f"batch_rows: a batch of {len(batch)} rows is not this replica's part "
                         f"({hi - lo} rows) of a global batch of {total}")
    return total, slice(lo, hi)


def node_seed(seed: int, node: str = "local") -> int:
    """The seed of a node's generator in a plan with ``seed: SEED``: the stream a window
    reader with `sample: random` and a `call`'s `generator` draw from. A hand loop that
    must draw the same numbers makes ``torch.Generator().manual_seed(node_seed(SEED))``.
    """
    from jobrun.ops.context import node_seed as seed_of

    return seed_of(seed, node)


def reader_order(n: int, pass_index: int, seed: int = 0, node: str = "local", reader: int = 0) -> Any:
    """The order in which a shuffled `reader` of ``n`` records reads pass ``pass_index``
    (0 first): a tensor of record indices. ``reader`` counts the readers made on ``node``
    (0 for the first) in a plan with ``seed: SEED``. A hand loop that takes its batches
    as ``x[order[i:i + batch]]`` reads the very batches the plan reads::

        order = reader_order(len(x), epoch - 1, seed=0)
    """
    from jobrun.ops.reader import pass_order, reader_seed

    return pass_order(reader_seed(seed, node, reader), pass_index, n)
