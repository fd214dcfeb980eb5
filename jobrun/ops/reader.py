"""The `reader` and `read` ops: batches over in-memory fields or a torch Dataset.

:class:`Reader` is what every reader shares: a position (pass, records read in the pass),
the shuffled order of a pass, the rank's part of a global batch, the `done` protocol and
the checkpointed state. :mod:`jobrun.ops.tensor_reader` reads in-memory fields,
:mod:`jobrun.ops.loader` torch Datasets through a DataLoader, by the same rules.

A reader walks its records in *global* batches of ``batch_size`` records. With ``world_size = R`` replicas, rank ``r`` returns its own
contiguous slice of every global batch (split like ``torch.tensor_split``), so the ranks
together cover each global batch exactly and ``replicas: 1`` and ``replicas: 2`` see the
same global batches. ``batch_size: 1`` yields single unbatched records; those cannot be
split, so every rank reads the same record (the gradient and evaluation means computed
by the training ops are unchanged by such replication).

The reader's state is a few integers (pass, position, shuffle seed), so checkpoints are
tiny and a shuffled pass is recomputed from its seed on load, identical on every rank.

Look-ahead. When `read` hands out a batch, the reader prepares the next one of the same
pass: gathers it on the host and starts its copy to the device
(:meth:`jobrun.ops.transfer.ToDevice.send`: on CUDA from pinned memory on a side stream,
so it travels while the step runs; elsewhere the copy is done at once). The next `read`
hands that batch out (a plain reader, CPU tensors in one process, gathers each batch
when `read` runs: nothing travels). The prepared batch is not part of the state: the
position names the next batch to hand out, a checkpoint taken between reads is the one
taken without look-ahead, and loading a state drops the prepared batch. The look-ahead stops at
the end of a pass (the `done` read and the first batch of the next pass are read when
`read` runs) and wherever preparing a batch could draw from the job's random streams (a
Dataset or stream read without workers, see :mod:`jobrun.ops.loader`). Random windows
draw their starts when `read` runs, as before (:mod:`jobrun.ops.windows`). A failure
while preparing a batch is raised by the `read` that would have handed it out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from jobrun.errors import RunError, a_type
from jobrun.ops.batches import counter, counts
from jobrun.ops.context import OpContext, mix
from jobrun.ops.split import global_records, rank_bounds
from jobrun.ops.transfer import ToDevice

_ORDINAL_KEY = "reader.ordinal"
_STATE_KEYS = ("pass", "position", "seed", "length")


def reader_seed(seed: int, node: str, ordinal: int) -> int:
    """The seed of the `ordinal`-th reader (0 first) made on `node` in a plan of `seed`."""
    return mix(seed, node, ordinal)


def pass_order(reader_seed: int, pass_index: int, n: int) -> torch.Tensor:
    """A shuffled reader's order of the `n` records of pass `pass_index`: a function of
    (reader seed, pass) alone (jobrun.reader_order gives it to hand loops)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(mix(reader_seed, pass_index)))


class Failed:
    """A look-ahead that raised: the `read` that would hand the batch out raises it."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _attempt(prepare: Any, args: tuple[Any, ...]) -> Any:
    """`prepare(*args)`, or its failure as a `Failed`."""
    try:
        return prepare(*args)
    except Exception as e:
        return Failed(e)


class Reader:
    """What every reader shares: a position in passes over `length` records, read in
    global batches; see the module docstring. Subclasses say how records are fetched
    (`read`, `full_pass`) and how many fields a batch has (`field_count`).
    """

    field_count = 1  # fields of a batch (the outputs of `read` before `done`)

    def __init__(
        self,
        length: int,
        *,
        batch_size: int = 1,
        shuffle: bool = False,
        passes: int = 1,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("passes", passes, minimum=0)
        self.length = length
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.passes = passes
        self.drop_last = bool(drop_last)
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.seed = seed
        # Instances of a task may read one reader at once: `read` takes it (the op does).
        self.lock = threading.Lock()
        self.pass_index = 0
        self.position = 0  # records of the current pass already read
        self._order: torch.Tensor | None = None  # the current pass's permutation
        self._order_pass = -1
        self._pass_end = self._records_per_pass()  # the geometry is fixed from here on
        if length and not self._pass_end:  # (a stream's length is not known: 0 here)
            # A pass always has a batch: a loop reading to a pass's end takes a step in each.
            raise RunError(
                f"reader: drop_last drops all {length} records, fewer than batch_size "
                f"{batch_size}: a pass would have no batch",
                hint=f"give a batch_size of at most {length}, or remove `drop_last: true`",
            )
        self._to_device = ToDevice(self.device)
        self._move = self.device.type != "cpu"  # batches are sent to the device
        # Batches are prepared on a thread of their own (those sent to a GPU; `_prepare`).
        self._threaded = self._move and self._to_device.cuda
        # Look-ahead (module docstring): the batch prepared by the last read, what
        # `ToDevice.send` returned or a `Failed`, and the position it starts at.
        self._ahead: Any = None
        self._ahead_at = -1
        # What this rank's reads handed out, for the throughput feed (jobrun.runner.
        # throughput): records and tokens, counted by `read` from what it knows, and the
        # seconds the `read` op took; `feed` is the feed that sums it.
        self.tally: list[Any] = [0, 0, 0.0]
        self.feed: Any = None
        self._width: int | None = None  # tokens per record (records of one shape), learnt

    # -- geometry -----------------------------------------------------------------

    @property
    def pass_end(self) -> int:
        """Records read per pass (a short final batch is skipped with drop_last)."""
        return self._pass_end

    def _records_per_pass(self) -> int:
        if self.drop_last and self.batch_size > 1:
            return self.length - self.length % self.batch_size
        return self.length

    @property
    def batches_per_pass(self) -> int:
        return -(-self.pass_end // self.batch_size)

    @property
    def finished(self) -> bool:
        return self.passes > 0 and self.pass_index >= self.passes

    def _pass_order(self) -> torch.Tensor:
        """The current pass's permutation: a function of (seed, pass) alone."""
        if self._order_pass != self.pass_index:
            self._order = pass_order(self.seed, self.pass_index, self.length)
            self._order_pass = self.pass_index
        return self._order  # type: ignore[return-value]

    def rank_part(self, start: int, stop: int) -> tuple[int, int]:
        """This rank's [lo, hi) of the global batch [start, stop) of a pass.

        A batch of single records (`batch_size: 1`) cannot be split: every rank reads it.
        """
        if self.batch_size == 1 or self.world_size == 1:
            return start, stop
        lo, hi = rank_bounds(stop - start, self.rank, self.world_size)
        return start + lo, start + hi

    # -- reading ------------------------------------------------------------------

    def read(self) -> tuple[Any, ...]:
        """The next batch as (*fields, done); see the `read` op."""
        raise NotImplementedError

    def full_pass(self) -> Iterator[tuple[Any, ...]]:
        """This rank's part of every global batch of one pass, in stored order; leaves
        the reading position alone (used by `evaluate`)."""
        raise NotImplementedError

    def _prepared(self, start: int) -> Any:
        """The batch the last read prepared if it starts at `start`, else None; taken.
        A batch being prepared on the look-ahead's thread is waited for either way, so
        nothing of the reader is used by two threads at once."""
        ahead, self._ahead = self._ahead, None
        if type(ahead) is Future:
            ahead = ahead.result()
        return ahead if self._ahead_at == start else None

    def _prepare(self, at: int, prepare: Any, *args: Any) -> None:
        """Prepare the batch at position `at` (look-ahead): `prepare(*args)`, its failure
        raised when the batch is handed out (by `_land`). Batches on their way to a GPU
        are prepared on a thread of the reader's (:meth:`ToDevice.submit`) while this one
        launches the step; elsewhere now."""
        if self._threaded:
            self._ahead = self._to_device.submit(_attempt, prepare, args)
        else:
            self._ahead = _attempt(prepare, args)
        self._ahead_at = at

    def _land(self, ahead: Any) -> tuple[Any, ...]:
        """A prepared batch's fields, usable by the computing stream."""
        if type(ahead) is Failed:
            raise ahead.error
        return self._to_device.land(ahead) if self._move else ahead

    def _handed(self, fields: tuple[Any, ...], n: int, total: int) -> None:
        """Count a global batch of `total` records, of which this rank got `n` (`fields`),
        of a reader whose records all have one shape: its tokens are `total` times those
        of a record, learnt from the first batch by the rule of jobrun.ops.batches (one
        integer-division, not a look at every batch). `fields` may end with the batch's
        `done` flag: the rule counts by the first field (or the dict of a reader with
        keys, which pairs keys and fields). The tally is the global batch's, so samples/s
        is right when ranks get unequal parts (a batch of 5 on 2 ranks: 3 and 2)."""
        tally = self.tally
        tally[0] += total
        width = self._width
        if width is None:
            if not n:
                return
            width = self._width = counts(self._as_handed(fields))[1] // n
        tally[1] += total * width

    def _handed_batch(self, fields: tuple[Any, ...]) -> None:
        """Count a batch by the rule of jobrun.ops.batches (records of many shapes: a
        Dataset's collated items); a batch of single records (`batch_size: 1`) is one.
        A rank's part of a split batch counts as the global batch (marked on it, see
        :func:`mark_records`), its tokens scaled alike: exact for records of one length,
        an estimate from this rank's part for others."""
        n, tokens = counts(self._as_handed(fields)) if self.batch_size > 1 else (1, 0)
        first = fields[0] if fields else None
        # a dict batch: its tensors are tagged, not the dict; the one that counts its records
        total = global_records(counter(first) if isinstance(first, Mapping) else first)
        if total is not None and n:
            tokens = tokens * total // n
            n = total
        self.tally[0] += n
        self.tally[1] += tokens

    def _as_handed(self, fields: tuple[Any, ...]) -> tuple[Any, ...]:
        """A batch's fields as `read` hands them out (a reader with keys: one dict)."""
        return fields

    def _end_of_pass(self) -> tuple[Any, ...]:
        if not self.finished:
            self.pass_index += 1
            self.position = 0
        return (*([None] * self.field_count), True)

    # -- checkpointing ------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Plain ints: the permutation of a pass is recomputed from `seed` on load."""
        return {
            "pass": self.pass_index,
            "position": self.position,
            "seed": self.seed,
            "length": self.length,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise RunError(
                f"reader state is missing {missing}",
                hint="the checkpoint was not written by this version of jobrun's reader",
            )
        values = {k: _as_int(k, state[k]) for k in _STATE_KEYS}
        if values["length"] != self.length:
            raise RunError(
                f"the reader's data changed: the checkpoint was taken over "
                f"{values['length']} records, the reader now has {self.length}",
                hint="resume with the same data the run started with, or start a new run",
            )
        if values["pass"] < 0 or not 0 <= values["position"] <= self.length:
            raise RunError(f"reader state is out of range: {values}")
        self.pass_index = values["pass"]
        self.position = values["position"]
        self.seed = values["seed"]
        self._order_pass = -1  # recompute the permutation lazily
        self._prepared(-1)  # prepared for the position left: dropped (once its thread is done)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(length={self.length}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, passes={self.passes}, pass={self.pass_index}, "
            f"position={self.position}, rank={self.rank}/{self.world_size})"
        )


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RunError(f"reader: {name} must be an integer >= {minimum}, got {value!r}")


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise RunError(f"reader state field {name!r} is not an integer: {value!r}")
    return int(value)


def reader_op(
    ctx: OpContext,
    *fields: Any,
    batch_size: int = 1,
    shuffle: bool = False,
    passes: int = 1,
    drop_last: bool = False,
    window: int | None = None,
    sample: str = "order",
    keys: list[str] | None = None,
    **loading: Any,
) -> Reader:
    """`reader`: fields... -> r, or one Dataset -> r (:mod:`jobrun.ops.loader`), or with
    `window` one token stream -> r over its windows (:mod:`jobrun.ops.windows`).

    The shuffle seed depends on (seed, node, creation order). `loading` holds the
    DataLoader's arguments (num_workers, pin_memory, ...), which need a Dataset. `keys`:
    its batches as one dict (:mod:`jobrun.ops.keyed`), as are those of one mapping of fields.
    """
    if keys is None and len(fields) == 1 and isinstance(fields[0], dict) and window is None:
        keys, fields = list(fields[0]), tuple(fields[0].values())  # {key: field}: keyed fields
    if keys is not None:
        from jobrun.ops.keyed import keyed

        made = reader_op(ctx, *fields, batch_size=batch_size, shuffle=shuffle, passes=passes,
                         drop_last=drop_last, window=window, sample=sample, **loading)
        return keyed(made, keys)
    ordinal = ctx.next_number(_ORDINAL_KEY)
    geometry: dict[str, Any] = dict(
        batch_size=batch_size, shuffle=shuffle, passes=passes, drop_last=drop_last,
        rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
        seed=reader_seed(ctx.seed, ctx.node, ordinal),
    )
    from jobrun.ops import loader

    if window is not None or sample != "order":
        if window is None:
            raise RunError("reader: sample applies to a reader of windows", hint="add window: T")
        if len(fields) != 1:
            raise RunError(f"reader: a reader of windows reads one token stream, got {len(fields)} inputs",
                           hint="in: tokens (its x and y are windows of the same stream)")
        from jobrun.ops.windows import WindowReader

        return WindowReader(fields[0], window, sample, ctx.generator, **geometry)
    if len(fields) == 1 and loader.is_dataset(fields[0]):
        return loader.dataset_reader(fields[0], geometry, {**loader.LOADING_DEFAULTS, **loading})
    given = sorted(k for k, v in loading.items() if v != loader.LOADING_DEFAULTS.get(k))
    if given:
        error = RunError(
            f"reader: {', '.join(given)} need(s) a torch Dataset as the one input; this reader "
            "reads in-memory fields",
            hint="wrap them in a Dataset to read them with workers, e.g. "
            "`build: {in: [x, y], out: ds, target: torch.utils.data.TensorDataset}`",
        )
        error.every_rank = True  # the plan's reader, made alike by every replica: the job's error
        raise error
    from jobrun.ops.tensor_reader import TensorReader

    return TensorReader(fields, **geometry)


def read_op(ctx: OpContext, reader: Reader, _out_names: tuple[str, ...] = (),
            _done_tested: bool = False) -> tuple[Any, ...]:
    """`read`: r -> fields..., done. With `done` left out of `out`, a pass's end is not the
    plan's concern: the read that meets it starts the next pass at once (a `passes: 0`
    reader then never ends), and only after the last pass are the fields null.
    `_done_tested`: a `stop_if` of the read's loop tests its last output, meant as `done`."""
    if not isinstance(reader, Reader):
        raise RunError(
            f"read expects a reader, got {a_type(reader)}",
            hint="create one with `reader: {in: [x, y], out: r}`",
        )
    progress = ctx.progress if ctx is not None else None  # no context: a reader used on its own
    feed = progress.get("feed") if progress is not None else None
    t0 = time.perf_counter() if feed is not None else 0.0
    with reader.lock:  # each of several instances reading it gets batches of its own
        batch = reader.read()
        rolls = len(_out_names) == reader.field_count  # a Dataset's is known after a read
        if batch[-1] and rolls and not reader.finished:
            batch = reader.read()
        if feed is not None:  # the read counted its records; the wait is added under the lock
            reader.tally[2] += time.perf_counter() - t0
            if reader.feed is not feed:
                feed.watch(reader)
    if rolls and _done_tested:  # the `done` tested would get the reader's last field
        last = _out_names[-1]
        raise _miscounted(reader, f"{len(_out_names) - 1} before `{last}`: `{last}` gets field "
                          f"{reader.field_count}, though a `stop_if` tests it as `done`")
    if rolls:  # one output is its value alone (a dict batch, a reader of one field)
        return batch[0] if reader.field_count == 1 else batch[:-1]
    if _out_names and len(_out_names) != len(batch):  # said of the reader, not of "the op"
        raise _miscounted(reader, f"{len(_out_names)}: {', '.join(_out_names)}")
    return batch


def _miscounted(reader: Reader, named: str) -> RunError:
    """A read whose `out` does not name the reader's fields, then `done`."""
    fields = reader.field_count
    return RunError(
        f"read: the reader gives {fields} field(s) a batch, then `done`, and `out` names {named}",
        hint=f"name {fields} field(s), then `done` (which may be left out); a Dataset's fields are "
        "the items of the tuple its __getitem__ returns (a tensor alone is one field)")


read_op.wants_out_names = True  # type: ignore[attr-defined]
