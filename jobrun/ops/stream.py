"""A reader over an IterableDataset: `reader` with one stream input (see :mod:`jobrun.ops.loader`).

The stream is read as its DataLoader yields it: global batches of `batch_size` (each
worker batches its own part of the stream), `shuffle` refused (a stream orders itself),
`drop_last` as torch does it. Every rank reads the whole stream and keeps its part of
each global batch, so the union over ranks is the global batch of one replica.

Its position is the batches read in the current pass; resume reads the pass again up to
there, with the worker seeds of that pass (a function of the reader's seed and the
pass). That is exact when the stream depends only on the dataset, the worker it runs in
and the seeds torch gives that worker; not when it draws from the main process's random
state (`num_workers: 0`) or carries random state from pass to pass
(`persistent_workers: true`).

With workers, `read` takes the next batch from the stream when it hands one out and starts
its copy to the device (look-ahead, see :mod:`jobrun.ops.reader`); the end of the stream
found that way is the next `read`'s `done`. Without workers the stream runs in the job's
process and may draw from its random streams: it is read when `read` runs, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jobrun.errors import RunError
from jobrun.ops.batches import records
from jobrun.ops.context import mix
from jobrun.ops.loader import (
    Options,
    as_fields,
    open_readers,
    part,
    shutdown,
)
from jobrun.ops.loader_failures import fetch, iterate
from jobrun.ops.reader import Failed, Reader, _as_int
from jobrun.ops.split import mark_records, rank_bounds

_END = object()  # a look-ahead that found the end of the stream


class IterableReader(Reader):
    """A reader over an IterableDataset; see the module docstring."""

    def __init__(self, dataset: Any, options: Options, **geometry: Any) -> None:
        super().__init__(0, **geometry)
        self.dataset = dataset
        self.options = options
        self._look_ahead = options.num_workers > 0  # see the module docstring
        self.field_count = 0
        self._iterator: Iterator[Any] | None = None
        batch = None if self.batch_size == 1 else self.batch_size
        self._loader = options.loader(dataset, batch_size=batch, drop_last=self.drop_last)
        if options.num_workers:
            open_readers.add(self)

    @property
    def pass_end(self) -> int:
        raise RunError(f"reader: {self.options.name} is a stream: its length is not known")

    def read(self) -> tuple[Any, ...]:
        if self.finished:
            return self._done()
        ahead = self._prepared(self.position)
        if ahead is None:
            ahead = self._next()
        if ahead is _END:
            self._stop()
            if not self.position:  # a pass always has a batch, as a Reader's geometry makes sure
                raise self._empty_pass()
            return self._done()
        if type(ahead) is Failed:
            raise ahead.error
        fields, n = self._land(ahead[0]), ahead[1]
        if n:
            mark_records(fields, n)
        self.position += 1
        if self._look_ahead:
            self._prepare(self.position, self._next)
        self._handed_batch(fields)
        return (*fields, False)

    def _next(self) -> Any:
        """The stream's next batch sent to the device, with the records of the global
        batch it is this rank's part of (0: not split); or `_END`."""
        if self._iterator is None:
            self._iterator = self._start()
        try:
            batch = fetch(self, self._iterator)
        except StopIteration:
            return _END
        fields, n = self._part(batch)
        return (self._to_device.send(fields) if self._move else fields), n

    def _empty_pass(self) -> RunError:
        which = f" of pass {self.pass_index + 1}" if self.pass_index else ""
        hint = "check the dataset's __iter__ (and its files)"
        if self.drop_last and self.batch_size > 1:
            hint += f"; with `drop_last: true`, fewer than {self.batch_size} records make no batch"
        return RunError(f"reader: the stream {self.options.name} ended before its first batch{which}", hint=hint)

    def _done(self) -> tuple[Any, ...]:
        if not self.field_count:
            raise RunError(f"reader: the stream {self.options.name} ended before its first batch",
                           hint="check the dataset's __iter__ (and its files)")
        return self._end_of_pass()

    def _start(self) -> Iterator[Any]:
        """An iterator at the reader's position: the pass is read again up to it."""
        self._loader.generator.manual_seed(mix(self.seed, "workers", self.pass_index))
        iterator = iterate(self, self._loader)
        for done in range(self.position):
            try:
                next(iterator)
            except StopIteration:
                raise RunError(
                    f"reader: the stream {self.options.name} ended after {done} batches while "
                    f"resuming at batch {self.position} of pass {self.pass_index}",
                    hint="the stream changed since the checkpoint was written",
                ) from None
        return iterator

    def full_pass(self) -> Iterator[tuple[Any, ...]]:
        self._loader.generator.manual_seed(mix(self.seed, "workers", "eval"))
        iterator = iterate(self, self._loader)
        while True:
            try:
                batch = fetch(self, iterator)
            except StopIteration:
                return
            fields, n = self._part(batch)
            if self._move:
                fields = self._to_device(fields)
            yield mark_records(fields, n) if n else fields

    def _part(self, batch: Any) -> tuple[tuple[Any, ...], int]:
        """This rank's part of a batch, and the records of the whole batch (0: not split)."""
        fields = as_fields(batch)
        n = 0
        if self.batch_size > 1 and self.world_size > 1:
            n = records(fields[0])
            lo, hi = rank_bounds(n, self.rank, self.world_size)
            fields = tuple(part(f, lo, hi) for f in fields)
        if not self.field_count:
            self.field_count = len(fields)
        return fields, n

    def _stop(self) -> None:
        iterator, self._iterator = self._iterator, None
        if iterator is not None and not self.options.persistent_workers:
            shutdown(iterator)

    def close(self) -> None:
        self._prepared(-1)  # a batch being prepared is waited for: its thread uses the iterator
        self._stop()
        shutdown(getattr(self._loader, "_iterator", None))

    def state_dict(self) -> dict[str, int]:
        return {"pass": self.pass_index, "batches": self.position, "seed": self.seed,
                "fields": self.field_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = ("pass", "batches", "seed", "fields")
        missing = [k for k in keys if k not in state]
        if missing:
            raise RunError(f"reader state is missing {missing}",
                           hint="the checkpoint holds the state of another kind of reader")
        values = {k: _as_int(k, state[k]) for k in keys}
        if values["pass"] < 0 or values["batches"] < 0:
            raise RunError(f"reader state is out of range: {values}")
        self.pass_index, self.position = values["pass"], values["batches"]
        self.seed, self.field_count = values["seed"], values["fields"]
        self._prepared(-1)  # prepared for the position left: dropped (once its thread is done)
        self._stop()
