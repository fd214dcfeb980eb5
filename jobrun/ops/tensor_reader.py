"""A reader over in-memory fields (tensors, numpy arrays or lists of one length): the
`reader` op's reader of anything but a Dataset or a token stream. What every reader
shares (position, passes, shuffled order, rank parts, look-ahead, state) is
:class:`jobrun.ops.reader.Reader`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from jobrun.errors import RunError
from jobrun.ops.reader import Reader
from jobrun.ops.split import mark_records


def _field_length(index: int, field: Any) -> int:
    if isinstance(field, torch.Tensor | np.ndarray):
        if field.ndim == 0:
            raise RunError(
                f"reader input {index} is a scalar; a reader iterates the first dimension",
                hint="pass a tensor, array or list with one entry per record",
            )
        return int(field.shape[0])
    if isinstance(field, Sequence) and not isinstance(field, str | bytes):
        return len(field)
    raise RunError(
        f"reader input {index} is a {type(field).__name__}; "
        "expected a tensor, a numpy array or a list (a torch Dataset is a reader's only input)",
        hint="load the data with data.load/data.synthetic, or read a Dataset alone: `in: dataset`",
    )


class TensorReader(Reader):
    """A reader over in-memory fields: tensors, numpy arrays or lists of equal length.

    Hot-path note: `read` does integer arithmetic and one slice (or, shuffled, one
    `index_select`) per field; the shuffled order of a pass is computed once when the pass
    starts.
    """

    def __init__(self, fields: Sequence[Any], **geometry: Any) -> None:
        if not fields:
            raise RunError("reader needs at least one input", hint="in: [x, y]")
        lengths = [_field_length(i, f) for i, f in enumerate(fields)]
        if len(set(lengths)) > 1:
            raise RunError(
                f"reader inputs have different lengths {lengths}",
                hint="every input must have one entry per record (same first dimension)",
            )
        if not lengths[0]:  # it "trained" an epoch of no steps and finished, as a Dataset's does not
            raise RunError("reader inputs have no records (their first dimension is 0)",
                           hint="check the data the reader is given (an empty file, a filter that kept nothing?)")
        super().__init__(lengths[0], **geometry)
        self.fields = tuple(fields)
        self.field_count = len(self.fields)
        # Batches already on the target device skip the move (a dispatch per field per read).
        self._move = any(isinstance(f, torch.Tensor) and f.device != self.device for f in self.fields)
        self._threaded = self._move and self._to_device.cuda
        self._plain = self._plain_fields()

    def _plain_fields(self) -> bool:
        """True when batches can skip rank slices, moves and per-field type checks.

        That is one process, batches (not single records) and only dense contiguous CPU
        tensors read on the CPU: the training loop's common case, where `read` is a slice
        of the pass order and one `index_select` per field (the values and layout of
        `field[idx]`, whose advanced indexing costs about 0.5 us more per field).
        """
        return (
            self.world_size == 1
            and self.batch_size > 1
            and self.device.type == "cpu"
            and all(
                type(f) is torch.Tensor
                and f.layout == torch.strided
                and f.is_cpu
                and f.is_contiguous()
                for f in self.fields
            )
        )

    def read(self) -> tuple[Any, ...]:
        """The next batch as (*fields, done); see the `read` op.

        Every training step runs this. A plain reader (see `_plain_fields`) gathers its
        batch when `read` runs: on the CPU nothing travels, so nothing is prepared ahead.
        Other readers hand out the batch the last read prepared and prepare the next one
        of the pass (look-ahead, see the module docstring).
        """
        start, end = self.position, self._pass_end
        if start >= end or (self.passes and self.pass_index >= self.passes):
            return self._end_of_pass()
        stop = start + self.batch_size
        if stop > end:
            stop = end
        self.position = stop
        if self._plain:
            if self.shuffle:
                idx = self._pass_order()[start:stop]
                fields = self.fields
                batch = (fields[0].index_select(0, idx), fields[1].index_select(0, idx), False) \
                    if len(fields) == 2 else (*self._select(idx), False)
            else:
                batch = (*self._take(start, stop, None), False)
            self._handed(batch, stop - start, stop - start)
            return batch
        order = self._pass_order() if self.shuffle else None
        ahead = self._prepared(start)
        fields = self._land(self._take(start, stop, order) if ahead is None else ahead)
        if stop < end:
            self._prepare(stop, self._take, stop, min(stop + self.batch_size, end), order)
        if self.world_size > 1 and self.batch_size > 1:
            mark_records(fields, stop - start)
        lo, hi = self.rank_part(start, stop)
        self._handed(fields, hi - lo, stop - start)
        return (*fields, False)

    def full_pass(self) -> Iterator[tuple[Any, ...]]:
        for start in range(0, self.pass_end, self.batch_size):
            yield self._land(self._take(start, min(start + self.batch_size, self.pass_end), None))

    def _take(self, start: int, stop: int, order: torch.Tensor | None) -> Any:
        """The batch [start, stop) of a pass (this rank's part), sent to the device."""
        if self._plain and order is None:  # slices of CPU tensors (shuffled: `read`)
            return tuple([f[start:stop] for f in self.fields])
        if self.batch_size == 1:
            # An unbatched record cannot be split: every rank reads the same one.
            i = start if order is None else int(order[start])
            fields = tuple(f[i] for f in self.fields)
        else:
            lo, hi = self.rank_part(start, stop)
            if order is None:
                fields = tuple(f[lo:hi] for f in self.fields)
            else:
                idx = order[lo:hi]
                fields = tuple(self._gather(f, idx) for f in self.fields)
        # gathered where the fields are, then moved as one batch (see jobrun.ops.transfer)
        return self._to_device.send(fields) if self._move else fields

    def _select(self, idx: torch.Tensor) -> tuple[Any, ...]:
        """The records `idx` of every field (plain readers only: CPU tensors)."""
        return tuple([f.index_select(0, idx) for f in self.fields])

    def _gather(self, field: Any, idx: torch.Tensor) -> Any:
        if isinstance(field, torch.Tensor):
            # on the host: gathered where the copy to the device starts (pinned on CUDA)
            return self._to_device.gather(field, idx) if field.is_cpu else field[idx.to(field.device)]
        if isinstance(field, np.ndarray):
            return field[idx.numpy()]
        return [field[i] for i in idx.tolist()]
