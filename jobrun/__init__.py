"""jobrun: run PyTorch training jobs described by declarative YAML plans.

For your own code (a `call`'s function): :func:`batch_rows`; for a hand loop that draws
what a plan draws: :func:`node_seed` and :func:`replica_seed`, and reads in a shuffled reader's order: :func:`reader_order`.
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


def replica_seed(seed: int, rank: int) -> int:
    """The seed of replica ``rank``'s global generators (torch's, numpy's, Python's) in a
    plan with ``seed: SEED`` and replicas: every replica runs init on the streams
    ``SEED`` starts, then each replica but 0 reseeds them with this, so that dropout and
    other draws of the epochs differ between replicas. A hand-written DDP loop that must
    draw the same numbers does, once its models are built::

        if rank > 0:
            torch.manual_seed(replica_seed(SEED, rank))  # and random.seed, np.random.seed

    (numpy's takes the seed modulo 2**32.)
    """
    from jobrun.runner.rng import replica_seed as seed_of

    return seed_of(seed, rank)


_ORDER_ARGS = {"n": "the number of records (windows for a window reader), a whole number >= 0",
               "pass_index": "the pass as a whole number >= 0, 0 first (epoch - 1 when an epoch reads one pass)",
               "seed": "the plan's `seed`, a whole number",
               "reader": "the number of readers the node made before this one, a whole number >= 0"}


def reader_order(n: int, pass_index: int, seed: int = 0, node: str = "local", reader: int = 0) -> Any:
    """The order in which a shuffled `reader` of ``n`` records reads pass ``pass_index``
    (0 first): a tensor of record indices. ``reader`` counts the readers made on ``node``
    (0 for the first) in a plan with ``seed: SEED``. A hand loop that takes its batches
    as ``x[order[i:i + batch]]`` reads the very batches the plan reads::

        order = reader_order(len(x), epoch - 1, seed=0)

    A count that is no whole number >= 0 (``epoch - 1`` of epoch 0, a float seed, which
    would silently give another order) is a ValueError.
    """
    import operator

    import torch

    from jobrun.ops.reader import pass_order, reader_seed

    counts = {"n": n, "pass_index": pass_index, "seed": seed, "reader": reader}
    for name, value in counts.items():
        try:  # numpy's and torch's integers as Python's; not a float tensor, nor one of several values
            whole = None if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool \
                else operator.index(value)
        except (TypeError, ValueError, RuntimeError):
            whole = None
        if whole is None or (name != "seed" and whole < 0):
            raise ValueError(f"reader_order: {name} is {value!r}; give {_ORDER_ARGS[name]}")
        counts[name] = whole
    if not isinstance(node, str):
        raise ValueError(f"reader_order: node is {node!r}; give the node's name as a string ('local' by default)")
    return pass_order(reader_seed(counts["seed"], node, counts["reader"]), counts["pass_index"], counts["n"])
