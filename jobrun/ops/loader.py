"""Readers over torch Datasets: `reader` with one Dataset input, fetched by a DataLoader.

    reader: {in: train_set, out: r, batch_size: 64, shuffle: true, num_workers: 2}

A map-style Dataset (``__getitem__`` and ``__len__``) is read by the rules of every
reader (:class:`jobrun.ops.reader.Reader`): the same pass orders, the same rank parts of
each global batch, the same `done`, the same checkpointed position (pass, records read,
seed). Torch's DataLoader does the fetching: worker processes, prefetching, `collate_fn`,
pinned memory, its timeout and its detection of dead workers.

Why a DataLoader with our own batch sampler and not torchdata's StatefulDataLoader: the
sampler starts each pass at the reader's position, so the position is the whole state
(a few ints, as for tensors) and resume is exact with workers too, because workers hand
batches back in order. StatefulDataLoader checkpoints what it iterated (sampler generator
state, per-worker snapshots of arbitrary dataset state) but not across ranks, which we
need anyway; it patches torch's samplers when imported; and it would be a dependency.

Random transforms. A worker fetches each batch under seeds made from (reader seed, pass,
batch start, rank) for Python's `random`, numpy's global RNG and torch's default
generator, so what a batch draws does not depend on which worker fetched it, on what
that worker fetched before (persistent workers) or on a resume. Workers are started by
PyTorch's rules (base seed from a generator seeded from the reader's seed and the pass,
each worker's `random`, numpy and torch seeded from it); they ignore SIGINT, which the
job handles. With `num_workers: 0` the transforms draw from the job's own random
streams, which checkpoints hold.

Look-ahead (see :mod:`jobrun.ops.reader`). With workers, `read` takes the next batch from
the DataLoader when it hands one out and starts its copy to the device, so the batch is on
its way while the step runs; what a worker draws is a function of the batch's seeds, not
of the moment it is taken. Without workers (`num_workers: 0`) the dataset's
``__getitem__`` runs in the job's process and may draw from the job's random streams, in
an order that the steps between two reads share: it runs when `read` runs, as before, and
nothing is prepared ahead.

An IterableDataset is read by :mod:`jobrun.ops.stream`.
"""

from __future__ import annotations

import atexit
import functools
import random
import signal
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate, default_convert

from jobrun.errors import RunError
from jobrun.ops.context import mix
from jobrun.ops.imports import resolve
from jobrun.ops.loader_failures import SampleError, fetch, iterate
from jobrun.ops.reader import Reader, _as_int, _check_int
from jobrun.ops.split import mark_records
from jobrun.signals import end_quietly

LOADING_DEFAULTS: dict[str, Any] = {
    "num_workers": 0,
    "pin_memory": False,
    "prefetch_factor": None,
    "persistent_workers": False,
    "collate_fn": None,
    "timeout": 0,
}


def is_dataset(value: Any) -> bool:
    """A torch Dataset, or an object that reads like one (``__getitem__`` and ``__len__``)
    without being in-memory data (a tensor, an array, a list)."""
    if isinstance(value, Dataset):
        return True
    if isinstance(value, torch.Tensor | np.ndarray | list | tuple | str | bytes | dict):
        return False
    return hasattr(value, "__getitem__") and hasattr(value, "__len__")


def dataset_reader(dataset: Any, geometry: dict[str, Any], loading: dict[str, Any]) -> Reader:
    """`reader` over one Dataset input: map-style or iterable."""
    options = Options(type(dataset).__name__, geometry, **loading)
    if isinstance(dataset, IterableDataset):
        if geometry.get("shuffle"):
            raise RunError(
                f"reader: shuffle applies to map-style datasets; {options.name} is an "
                "IterableDataset, which orders its own stream",
                hint="shuffle inside the dataset's __iter__, or drop `shuffle: true`",
            )
        from jobrun.ops.stream import IterableReader

        return IterableReader(dataset, options, **geometry)
    return DatasetReader(dataset, options, **geometry)


# ---------------------------------------------------------------------------- options


class Options:
    """The DataLoader arguments of a reader, checked once."""

    def __init__(self, name: str, geometry: dict[str, Any], *, num_workers: int, pin_memory: bool,
                 prefetch_factor: int | None, persistent_workers: bool, collate_fn: str | None,
                 timeout: float) -> None:
        self.name = name
        _check_int("num_workers", num_workers, minimum=0)
        if prefetch_factor is not None:
            _check_int("prefetch_factor", prefetch_factor, minimum=1)
        if num_workers == 0:
            # Nothing to keep or prefetch without workers (torch refuses both): so that
            # `vars.workers=0` (debugging in one process) needs no other change.
            prefetch_factor, persistent_workers = None, False
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise RunError(f"reader: timeout must be a number of seconds >= 0, got {timeout!r}")
        self.num_workers = num_workers
        # Pinned memory speeds up copies to a GPU only; torch warns about it elsewhere.
        self.pin_memory = bool(pin_memory) and torch.device(geometry.get("device", "cpu")).type == "cuda"
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = bool(persistent_workers)
        self.timeout = float(timeout)
        collate = default_collate if collate_fn is None else resolve(collate_fn, "reader", "collate_fn")
        # batch_size 1 reads single records, unbatched, as the tensor reader does (and as
        # torch does with batch_size=None: collate_fn sees one sample).
        self.collate: Callable[[list[Any]], Any] = (
            _Unbatched(default_convert if collate_fn is None else collate)
            if geometry.get("batch_size", 1) == 1 else _Collate(collate)
        )

    def loader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        workers = self.num_workers
        if workers:
            _settle_record_function()
        return DataLoader(
            dataset, num_workers=workers, collate_fn=self.collate, pin_memory=self.pin_memory,
            timeout=self.timeout if workers else 0, generator=torch.Generator(),
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=self.persistent_workers, worker_init_fn=_worker_init if workers else None,
            **kwargs,
        )


@functools.cache
def _settle_record_function() -> None:
    """Enter torch's record_function once, before any worker runs. DataLoader's `next()`
    enters it, and the first entry imports a profiler module inside a try whose errors torch
    logs with a traceback. A worker's death raises from torch's SIGCHLD handler in whatever
    the main thread runs, so a worker dying during a reader's first `next()` printed a
    traceback beside our message."""
    with torch.autograd.profiler.record_function("jobrun.reader"):
        pass


class _Collate:
    """collate_fn, naming the samples of a batch it could not collate and the first one
    whose make differs from the batch's first (torch said "stack expects each tensor to be
    equal size ... at entry 2", of no sample anyone knows)."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, samples: list[Any]) -> Any:
        try:
            return self.fn(samples)
        except Exception as e:
            indices = _FETCHED[0] if len(_FETCHED[0]) == len(samples) else list(range(len(samples)))
            first = _make(samples[0])
            odd = next((k for k, x in enumerate(samples) if _make(x) != first), None)
            said = "" if odd is None else (f"; sample {indices[odd]} is {_make(samples[odd])}, "
                                           f"sample {indices[0]} {first}")
            mine = self.fn is not default_collate  # a user's collate_fn: its frames are worth showing
            raise SampleError(f"samples {indices} could not be collated: {type(e).__name__}: {e}{said}") \
                from (e if mine else None)


def _make(sample: Any) -> str:
    """What a sample is made of, as a message names it: `a tuple of 2 (tensor [3], int)`."""
    if isinstance(sample, torch.Tensor | np.ndarray):
        return f"{'tensor' if isinstance(sample, torch.Tensor) else 'array'} {list(sample.shape)}"
    if isinstance(sample, tuple | list):
        return f"a {type(sample).__name__} of {len(sample)} ({', '.join(_make(x) for x in sample[:8])})"
    if isinstance(sample, dict):
        return f"a dict of {', '.join(map(str, sample))}"
    return "None" if sample is None else type(sample).__name__


_FETCHED: list[list[int]] = [[]]  # the indices this process fetched last (what it collates next)


class _Unbatched:
    """collate_fn of single records: applied to the one sample of a batch."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, samples: list[Any]) -> Any:
        return self.fn(samples[0])


open_readers: weakref.WeakSet[Any] = weakref.WeakSet()  # readers that may have workers running


@atexit.register  # registered after multiprocessing's: runs before it terminates the workers
def close_all() -> None:
    """Stop the workers of every reader (a job's end; at exit, what is left)."""
    for reader in list(open_readers):
        reader.close()


def shutdown(iterator: Any) -> None:
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _worker_init(worker_id: int) -> None:
    # A signal to the process group reaches the workers too (see jobrun.signals): the job
    # stops them itself. Forked, a worker would run the job's own handler.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, end_quietly)
    sys.excepthook = functools.partial(_sharing_broke, sys.excepthook)


def _sharing_broke(previous: Callable[..., None], kind: type, value: BaseException, tb: Any) -> None:
    """A worker's excepthook. multiprocessing's thread that hands the main process the
    file descriptors of batches prints a connection broken mid-handshake through
    sys.excepthook: the main process stopped taking batches (another worker died, the job
    stops), which the job reports itself; a traceback of it on the job's stderr only
    misled (seen as 'Traceback ... resource_sharer.py, in _serve')."""
    import traceback

    frames = traceback.extract_tb(tb) if tb is not None else []
    if not (issubclass(kind, OSError | EOFError) and any(f.filename.endswith("resource_sharer.py") for f in frames)):
        previous(kind, value, tb)


# ---------------------------------------------------------------------------- map-style


class _Indices(list):
    """One batch's sample indices, and the seed its fetch runs under in a worker."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed


class _Batches:
    """The batch sampler: this rank's indices of each global batch of the current pass,
    from the reader's position (or, for `full_pass`, all of them in stored order)."""

    def __init__(self, reader: DatasetReader, full: bool) -> None:
        # Weak: a reader dropped by its last reference stops its workers at once (in a
        # cycle, the garbage collector may close their queues first: 5 s per worker).
        self.reader = weakref.proxy(reader)
        self.full = full

    def __iter__(self) -> Iterator[_Indices]:
        r = self.reader
        start, end, size = (0 if self.full else r.position), r.pass_end, r.batch_size
        order = r._pass_order() if r.shuffle and not self.full else None
        tag = "eval" if self.full else r.pass_index
        for s in range(start, end, size):
            lo, hi = r.rank_part(s, min(s + size, end))
            if lo == hi:  # an empty part of a short batch: one record of the batch (the
                lo, hi = s, s + 1  # next one may be past the data), cut to none by `read`
            ids = range(lo, hi) if order is None else order[lo:hi].tolist()
            yield _Indices(list(ids), mix(r.seed, tag, s, r.rank))

    def __len__(self) -> int:
        r = self.reader
        return -(-(r.pass_end - (0 if self.full else r.position)) // r.batch_size)


class _Fetch(Dataset):
    """The dataset the DataLoader sees: fetches a batch under its seed, naming the
    sample that failed."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.batched = callable(getattr(dataset, "__getitems__", None))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        _FETCHED[0] = list(indices)
        seed = getattr(indices, "seed", None)
        if seed is not None and get_worker_info() is not None:
            random.seed(seed)
            np.random.seed(seed & 0xFFFF_FFFF)  # numpy's legacy seed takes 32 bits
            torch.default_generator.manual_seed(seed)  # not torch.manual_seed: 100x slower
        if self.batched:
            try:
                return self.dataset.__getitems__(list(indices))
            except Exception as e:
                raise SampleError(f"samples {list(indices)}: {type(e).__name__}: {e}") from e
        out = []
        for i in indices:
            try:
                out.append(self.dataset[i])
            except Exception as e:
                raise SampleError(f"sample {i}: {type(e).__name__}: {e}") from e
        return out


class DatasetReader(Reader):
    """A reader over a map-style Dataset; see the module docstring."""

    def __init__(self, dataset: Any, options: Options, **geometry: Any) -> None:
        try:
            length = len(dataset)
        except TypeError as e:
            raise RunError(
                f"reader: {options.name} has no length ({e})",
                hint="a map-style Dataset needs __len__; a stream is an IterableDataset",
            ) from e
        if length == 0:
            raise RunError(f"reader: the dataset {options.name} is empty",
                           hint="check how the dataset is built (its files, its split)")
        super().__init__(length, **geometry)
        self.dataset = dataset
        self.options = options
        self.field_count = 0  # learned from the first batch, kept in the state
        self._loader = options.loader(_Fetch(dataset), batch_sampler=_Batches(self, full=False))
        self._eval_loader: DataLoader | None = None
        self._iterator: Iterator[Any] | None = None
        self._look_ahead = options.num_workers > 0  # see the module docstring
        if options.num_workers:
            open_readers.add(self)

    def read(self) -> tuple[Any, ...]:
        start, end = self.position, self._pass_end
        if start >= end or self.finished:
            self._stop()
            if not self.field_count:  # e.g. resumed at a pass's end from a state without "fields"
                self.field_count = len(as_fields(self._probe()))
            return self._end_of_pass()
        ahead = self._prepared(start)
        fields = self._land(self._next(start) if ahead is None else ahead)
        stop = min(start + self.batch_size, end)
        self.position = stop
        if self._look_ahead and stop < end:
            self._prepare(stop, self._next, stop)
        if self.world_size > 1 and self.batch_size > 1:
            mark_records(fields, stop - start)
        self._handed_batch(fields)
        return (*fields, False)

    def _next(self, start: int) -> Any:
        """The pass's batch at `start` (the next one of the iterator), sent to the device."""
        if self._iterator is None:
            # Worker seeds are a function of (seed, pass), wherever reading resumes.
            self._loader.generator.manual_seed(mix(self.seed, "workers", self.pass_index))
            self._iterator = iterate(self, self._loader)
        batch = fetch(self, self._iterator)
        lo, hi = self.rank_part(start, min(start + self.batch_size, self._pass_end))
        fields = self._fields(batch, empty=lo == hi)
        return self._to_device.send(fields) if self._move else fields

    def full_pass(self) -> Iterator[tuple[Any, ...]]:
        if self._eval_loader is None:
            self._eval_loader = self.options.loader(_Fetch(self.dataset), batch_sampler=_Batches(self, full=True))
            self._eval_loader.generator.manual_seed(mix(self.seed, "workers", "eval"))
        iterator = iterate(self, self._eval_loader)
        for start in range(0, self.pass_end, self.batch_size):
            batch = fetch(self, iterator)
            lo, hi = self.rank_part(start, min(start + self.batch_size, self.pass_end))
            fields = self._fields(batch, empty=lo == hi)
            yield self._to_device(fields) if self._move else fields

    def _fields(self, batch: Any, empty: bool) -> tuple[Any, ...]:
        fields = as_fields(batch)
        if empty:
            fields = tuple(part(f, 0, 0) for f in fields)
        if self.field_count != len(fields):
            if self.field_count:
                raise RunError(
                    f"reader: batches of {self.options.name} had {self.field_count} field(s), "
                    f"this one has {len(fields)}",
                    hint="__getitem__ must return samples of one structure",
                )
            self.field_count = len(fields)
        return fields

    def _probe(self) -> Any:
        """One collated sample, fetched here without touching the job's random state."""
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            return self.options.collate(_Fetch(self.dataset).__getitems__([0]))
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])

    def _stop(self) -> None:
        """Drop the pass's iterator (its workers exit, unless they persist)."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None and not self.options.persistent_workers:
            shutdown(iterator)

    def close(self) -> None:
        """Stop every worker of this reader, persistent ones too (at exit)."""
        self._prepared(-1)  # a batch being prepared is waited for: its thread uses the iterator
        self._stop()
        for loader in (self._loader, self._eval_loader):
            shutdown(getattr(loader, "_iterator", None))

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "fields": self.field_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "fields" in state:
            self.field_count = _as_int("fields", state["fields"])
        self._stop()  # the next read starts where the checkpoint says


# ---------------------------------------------------------------------------- batches


def as_fields(batch: Any) -> tuple[Any, ...]:
    """A collated batch as the fields `read` outputs: a tuple or list is its fields."""
    return tuple(batch) if isinstance(batch, tuple | list) else (batch,)


def part(value: Any, lo: int, hi: int) -> Any:
    """Records [lo, hi) of a collated field (tensors, arrays, lists; dicts of them)."""
    if isinstance(value, Mapping):
        return {k: part(v, lo, hi) for k, v in value.items()}
    if isinstance(value, torch.Tensor | np.ndarray | list | tuple) and (
        not hasattr(value, "ndim") or value.ndim
    ):
        return value[lo:hi]
    return value
