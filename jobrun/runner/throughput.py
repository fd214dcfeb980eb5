"""Throughput and memory: samples/s (tokens/s), the time steps wait for data, peak memory.

Every `read` op adds its batch to the run's `Feed` (records, tokens when the batch is a
sequence of token ids, the seconds `read` took: the time a step waited for its data).
The runner takes the difference over each epoch (`EpochRates`): samples/s over the
epoch's time, the data wait against the rest (compute), and the peak memory: CUDA's
allocator on a GPU (reset each epoch), the process's peak RSS on CPU (never reset:
the peak so far). Nothing here reads a device value, so no step waits for the GPU.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping
from typing import Any

from jobrun.ops.batches import counter, records

INT_KINDS = frozenset("iu")  # numpy/torch dtype kinds that hold token ids


class Feed:
    """What `read` ops delivered so far (one per run; shared by every task's context).

    Every reader adds to a tally of its own, while `read` holds the reader's lock (the
    instances of a task that read one reader take turns there): no two threads ever add
    to one tally, so the feed has no lock of its own (taking one cost 0.4 us of a read's
    0.85 us), and the totals are the tallies' sums.
    """

    __slots__ = ("tallies",)

    def __init__(self) -> None:
        # id(reader) -> [records, tokens, seconds]. A dead reader's id taken by a new one
        # continues its tally: the sums are the same, and the dead one reads no more.
        self.tallies: dict[int, list[Any]] = {}

    def add(self, batch: tuple[Any, ...], seconds: float, source: Any = None) -> None:
        """One `read` of `source` (a reader, whose lock the caller holds): its batch
        (fields..., done) and the seconds it took (every step runs this: a shape and a
        dtype test, no call into torch beyond them)."""
        x = batch[0]
        if batch[-1] is True:  # the end of a pass: no records
            shape, n = None, 0
        else:  # a batch, or one record (batch_size 1, or no shape: a Python value)
            shape = getattr(x, "shape", None)
            if shape:
                n = shape[0]
            elif isinstance(x, Mapping):  # a dict batch: counted as train.step counts it
                x = counter(x)  # records() of the mapping would look it up again
                n = records(x) if x is not None else 0  # None: an empty mapping
                shape = getattr(x, "shape", None)
            else:
                n = 1
        tally = self.tallies.get(id(source))
        if tally is None:
            tally = self.tallies.setdefault(id(source), [0, 0, 0.0])
        tally[0] += n
        tally[2] += seconds
        if shape and len(shape) == 2:  # token ids: an integer (batch, sequence) tensor
            ints = _INT_DTYPES.get(getattr(x, "dtype", None))  # _is_int, its call inlined
            if ints or (ints is None and _is_int(x)):
                tally[1] += n * shape[1]

    def snapshot(self) -> tuple[int, int, float]:
        """(records, tokens, seconds) over every reader so far."""
        tallies = list(self.tallies.values())  # one C call: a new reader may come meanwhile
        return (sum(t[0] for t in tallies), sum(t[1] for t in tallies), sum(t[2] for t in tallies))

    @property
    def records(self) -> int:
        return self.snapshot()[0]

    @property
    def tokens(self) -> int:
        return self.snapshot()[1]


def _is_int(x: Any) -> bool:
    """Whether x holds integers (torch's or numpy's), by a dict lookup of its dtype: the
    test runs at every `read` (getattr(dtype, "kind", "") of a torch dtype raised and
    caught an AttributeError each time, 4k instructions)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    known = _INT_DTYPES.get(dtype)
    if known is None:
        known = _INT_DTYPES[dtype] = _holds_ints(dtype)
    return known


_INT_DTYPES: dict[Any, bool] = {}  # dtype -> whether it holds integers, learnt as read


def _holds_ints(dtype: Any) -> bool:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                         torch.uint16, torch.uint32, torch.uint64)
    return getattr(dtype, "kind", "") in INT_KINDS


class EpochRates:
    """One epoch's throughput, from the feed at its start and end."""

    def __init__(self, feed: Feed, device: str, world_size: int):
        self.feed = feed
        self.device = device
        self.world = world_size
        self.start = feed.snapshot()
        if device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(device)

    def finish(self, seconds: float) -> dict[str, Any]:
        """The epoch's figures for its line and its metrics record (rank 0's reads times
        the replicas: each reads an equal part of every global batch)."""
        records, tokens, wait = (b - a for a, b in zip(self.start, self.feed.snapshot()))
        out: dict[str, Any] = {}
        if records and seconds > 0:
            out["samples_per_s"] = round(records * self.world / seconds, 3)
            if tokens:
                out["tokens_per_s"] = round(tokens * self.world / seconds, 3)
            out["data_s"] = round(wait, 6)
            out["compute_s"] = round(max(seconds - wait, 0.0), 6)
        out["peak_memory_bytes"] = peak_memory(self.device)
        return out


def peak_memory(device: str) -> int:
    """The peak memory: CUDA's allocator on a GPU, else this process's peak RSS."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KB on Linux


def epoch_text(rates: dict[str, Any], seconds: float, human_size: Any) -> str:
    """The epoch line's part: `12.4k samples/s  data 8%  peak 312.0 MB`."""
    from jobrun.runner.display import human_count

    parts = []
    if "tokens_per_s" in rates:
        parts.append(f"{human_count(rates['tokens_per_s'])} tokens/s")
    elif "samples_per_s" in rates:
        parts.append(f"{human_count(rates['samples_per_s'])} samples/s")
    if "data_s" in rates and seconds > 0:
        parts.append(f"data {rates['data_s'] / seconds:.0%}")
    if rates.get("peak_memory_bytes"):
        parts.append(f"peak {human_size(rates['peak_memory_bytes'])}")
    return "  ".join(parts)
