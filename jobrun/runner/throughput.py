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
import threading
from typing import Any

INT_KINDS = frozenset("iu")  # numpy/torch dtype kinds that hold token ids


class Feed:
    """What `read` ops delivered so far (one per run; shared by every task's context)."""

    __slots__ = ("records", "tokens", "wait", "lock")

    def __init__(self) -> None:
        self.records = 0
        self.tokens = 0
        self.wait = 0.0
        self.lock = threading.Lock()  # instances and parallel tasks read at once

    def add(self, batch: tuple[Any, ...], seconds: float) -> None:
        """One `read`: its batch (fields..., done) and the seconds it took (every step runs
        this: a shape, a dtype test and a lock, no call into torch beyond them)."""
        x = batch[0]
        if x.__class__ is dict and x:  # a dict batch: its first field counts its records
            x = next(iter(x.values()))
        if batch[-1] is True:  # the end of a pass: no records
            shape, n = None, 0
        else:  # a batch, or one record (batch_size 1, or no shape: a Python value)
            shape = getattr(x, "shape", None)
            n = shape[0] if shape else 1
        # Token ids: an integer (batch, sequence) tensor; its records are sequences.
        tokens = n * shape[1] if shape and len(shape) == 2 and _is_int(x) else 0
        with self.lock:
            self.records += n
            self.tokens += tokens
            self.wait += seconds

    def snapshot(self) -> tuple[int, int, float]:
        return self.records, self.tokens, self.wait


def _is_int(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if _TOKEN_DTYPES is None:
        _token_dtypes()
    return dtype in _TOKEN_DTYPES or getattr(dtype, "kind", "") in INT_KINDS


_TOKEN_DTYPES: frozenset[Any] | None = None  # torch's integer dtypes, once torch is imported


def _token_dtypes() -> None:
    global _TOKEN_DTYPES
    import torch

    _TOKEN_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                               torch.uint16, torch.uint32, torch.uint64})


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
