"""A reader of windows over a 1-D token stream: `reader: {in: tokens, window: T}`.

Each record is a window of T + 1 tokens starting at i, read as ``x = tokens[i : i+T]`` and
``y = tokens[i+1 : i+T+1]`` (int64: what embeddings and cross_entropy take), a batch of B
windows as two [B, T] tensors. It is a :class:`~jobrun.ops.reader.Reader`, so passes,
`done`, the rank's part of each global batch and the checkpointed position are the ones
every reader has:

- ``sample: order`` (the default): the windows that do not overlap, i = 0, T, 2T, ...,
  walked in passes like any reader's records (``shuffle: true``: a seeded permutation a
  pass).
- ``sample: random``: each global batch draws B starts uniformly from the node's
  generator (``torch.randint(len(tokens) - T, (B,), generator=...)``, as nanoGPT's
  get_batch draws them), endlessly: it is never `done`. Every rank draws the whole global
  batch's starts from the same generator and keeps its own slice, so the ranks read
  disjoint parts of one global batch, and the global batches are the same whatever the
  replica count. The generator's state is in every checkpoint: a resume draws on exactly.

The stream itself (a memory-mapped token file, say) is read, never copied: a batch
gathers its windows' tokens alone.

Look-ahead (see :mod:`jobrun.ops.reader`): when `read` hands out a batch it prepares the
next one (gathered, its copy to the device started). In order, that is the next batch of
the pass. Random windows: the node's generator still draws a batch's starts when `read`
runs (a checkpoint between reads holds its state after the batch handed out, as before);
the next batch is prepared from a copy of the generator, and handed out when the starts
that `read` draws are the same (they are unless something else drew from the generator).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from jobrun.errors import RunError
from jobrun.ops.reader import Reader
from jobrun.ops.split import mark_records

SAMPLES = ("order", "random")


class WindowReader(Reader):
    field_count = 2  # x, y

    def __init__(self, tokens: Any, window: int, sample: str, generator: torch.Generator,
                 **geometry: Any) -> None:
        tokens = _stream(tokens)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise RunError(f"reader: window must be a whole number of tokens >= 1, got {window!r}")
        if sample not in SAMPLES:
            raise RunError(f"reader: unknown sample {sample!r}", hint="sample: order or sample: random")
        if tokens.numel() <= window:
            raise RunError(f"reader: the stream has {tokens.numel()} tokens, too few for one window of "
                           f"{window} (and the token after it)", hint="load a longer stream or a smaller window")
        self.tokens = tokens
        self.window = window
        self.random = sample == "random"
        self.generator = generator
        self._peek = torch.Generator()  # draws the next batch's starts ahead (look-ahead)
        self._ahead_starts: torch.Tensor | None = None
        self._span = torch.arange(window + 1)
        # Random starts: every start with a whole window after it; in order: the windows
        # that do not overlap (records of the Reader's passes).
        count = tokens.numel() - window if self.random else (tokens.numel() - 1) // window
        super().__init__(count, **geometry)

    def _records_per_pass(self) -> int:
        """Random windows have no passes: `drop_last` does nothing to them."""
        return self.length if self.random else super()._records_per_pass()

    def read(self) -> tuple[Any, ...]:
        """The next batch as (x, y, done); see the `read` op."""
        if self.random:
            return (*self._random(), False)
        start, end = self.position, self.pass_end
        if start >= end or self.finished:
            return self._end_of_pass()
        stop = min(start + self.batch_size, end)
        self.position = stop
        order = self._pass_order() if self.shuffle else None
        ahead = self._prepared(start)
        fields = self._land(self._take(start, stop, order) if ahead is None else ahead)
        if stop < end:
            self._prepare(stop, self._take, stop, min(stop + self.batch_size, end), order)
        if self.world_size > 1 and self.batch_size > 1:  # train.step weights by the share
            mark_records(fields, stop - start)
        lo, hi = self.rank_part(start, stop)
        self._handed(fields, hi - lo, stop - start)
        return (*fields, False)

    def _random(self) -> tuple[Any, ...]:
        """A batch of random windows: this rank's part of B starts drawn now."""
        lo, hi = self.rank_part(0, self.batch_size)
        starts = torch.randint(self.length, (self.batch_size,), generator=self.generator)[lo:hi]
        ahead, prepared = self._prepared(0), self._ahead_starts
        if ahead is None or prepared is None or not torch.equal(prepared, starts):
            ahead = self._send(starts)
        fields = self._land(ahead)
        peek = self._peek
        peek.set_state(self.generator.get_state())
        nxt = torch.randint(self.length, (self.batch_size,), generator=peek)[lo:hi]
        self._prepare(0, self._send, nxt)
        self._ahead_starts = nxt
        if self.world_size > 1 and self.batch_size > 1:
            mark_records(fields, self.batch_size)
        self._handed(fields, hi - lo, self.batch_size)
        return fields

    def full_pass(self) -> Iterator[tuple[Any, ...]]:
        if self.random:
            raise RunError("a reader of random windows has no pass to evaluate over: it never ends",
                           hint="evaluate over a number of its batches, or read windows in order "
                           "(sample: order)")
        for start in range(0, self.pass_end, self.batch_size):
            yield self._land(self._take(start, min(start + self.batch_size, self.pass_end), None))

    def _take(self, start: int, stop: int, order: torch.Tensor | None) -> Any:
        """The windows [start, stop) of a pass (this rank's part), in order or permuted,
        sent to the device."""
        lo, hi = self.rank_part(start, stop)
        index = torch.arange(lo, hi) if order is None else order[lo:hi]
        x, y = self._windows(index * self.window)
        if self.batch_size == 1:  # one record, unbatched
            x, y = x[0], y[0]
        return self._to_device.send((x, y)) if self._move else (x, y)

    def _send(self, starts: torch.Tensor) -> Any:
        fields = self._windows(starts)
        return self._to_device.send(fields) if self._move else fields

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[starts[:, None] + self._span].to(torch.int64)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def __repr__(self) -> str:
        return (f"WindowReader(tokens={self.tokens.numel()}, window={self.window}, "
                f"sample={'random' if self.random else 'order'}, batch_size={self.batch_size}, "
                f"pass={self.pass_index}, position={self.position}, rank={self.rank}/{self.world_size})")


def _stream(tokens: Any) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor) and tokens.ndim == 1 and not tokens.is_floating_point() \
            and not tokens.is_complex() and tokens.dtype != torch.bool:
        return tokens
    if hasattr(tokens, "ndim") and hasattr(tokens, "dtype"):
        what = f"a {tokens.ndim}-D {tokens.dtype} {type(tokens).__name__}"
    else:
        what = f"a {type(tokens).__name__}"
    raise RunError(f"reader: window reads a 1-D stream of integer tokens, got {what}",
                   hint="load one with data.load (e.g. path: train.bin, dtype: uint16); a 2-D "
                   "array can be flattened first")
