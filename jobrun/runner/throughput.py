"""Throughput and memory: samples/s (tokens/s), the time steps wait for data, peak memory.

Every reader counts what its `read`s hand out (records, tokens when the batch is a
sequence of token ids) and the `read` op the seconds it took (the time a step waited for
its data); the run's `Feed` sums the readers' tallies.
The runner takes the difference over each epoch (`EpochRates`): samples/s over the
epoch's time, the data wait against the rest (compute), and the peak memory: CUDA's
allocator on a GPU (reset each epoch), the process's peak RSS on CPU (never reset:
the peak so far). Nothing here reads a device value, so no step waits for the GPU.
"""

from __future__ import annotations

import resource
import sys
from typing import Any


class Feed:
    """What `read` ops delivered so far (one per run; shared by every task's context).

    Every reader keeps a tally of its own (`Reader.tally`: records, tokens, seconds):
    its `read` counts what it hands out from what it already knows (a reader of records
    of one shape: the batch's bounds, and the tokens of a record learnt once; a Dataset's
    batches by the rule of jobrun.ops.batches), and the `read` op adds the seconds it
    took, under the reader's lock. The feed only sums the tallies of the readers it
    watches (the first `read` of a reader in the run starts watching it): a look at every
    batch's shape and dtype cost 1 % of a small MLP's step. No two threads ever add to
    one tally, so the feed takes no lock.
    """

    __slots__ = ("tallies",)

    def __init__(self) -> None:
        self.tallies: list[list[Any]] = []  # [records, tokens, seconds] per watched reader

    def watch(self, reader: Any) -> None:
        """Sum `reader`'s tally from now on (what it counted before is in the totals)."""
        reader.feed = self
        self.tallies.append(reader.tally)

    def snapshot(self) -> tuple[int, int, float]:
        """(records, tokens, seconds) over every reader so far."""
        tallies = list(self.tallies)  # one C call: a new reader may come meanwhile
        return (sum(t[0] for t in tallies), sum(t[1] for t in tallies), sum(t[2] for t in tallies))

    @property
    def records(self) -> int:
        return self.snapshot()[0]

    @property
    def tokens(self) -> int:
        return self.snapshot()[1]


class EpochRates:
    """One epoch's throughput, from the feed at its start and end."""

    def __init__(self, feed: Feed, device: str):
        self.feed = feed
        self.device = device
        self.start = feed.snapshot()
        if device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(device)

    def finish(self, seconds: float) -> dict[str, Any]:
        """The epoch's figures for its line and its metrics record: rank 0's readers
        count the global batches that the ranks' parts make up (Reader._handed)."""
        records, tokens, wait = (b - a for a, b in zip(self.start, self.feed.snapshot()))
        out: dict[str, Any] = {}
        if records and seconds > 0:
            out["samples_per_s"] = round(records / seconds, 3)
            if tokens:
                out["tokens_per_s"] = round(tokens / seconds, 3)
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
