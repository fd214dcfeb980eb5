"""Readers whose batches are one dict: `reader: {in: [x, x], keys: [input_ids, labels]}`.

A reader over in-memory fields (or a reader of windows) with ``keys`` gives each batch as
one mapping ``{key: field}`` (so does a reader whose one input is a mapping of fields),
the keyword arguments of a model that computes its loss
(`train.step: {in: [model, opt, batch], loss: model}` calls ``model(**batch)``), as a
Dataset whose items are dicts gives them through the DataLoader's collate. Everything
else is the reader's own: passes, shuffling, the rank's part of each global batch (each
tensor tagged with the records of the whole batch), the checkpointed position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jobrun.errors import RunError
from jobrun.ops.reader import Reader
from jobrun.ops.tensor_reader import TensorReader
from jobrun.ops.windows import WindowReader


class _Keyed:
    """A reader's batches as one dict; the reader's class goes after this one."""

    keys: tuple[str, ...] = ()

    def read(self) -> tuple[Any, ...]:
        *fields, done = super().read()  # type: ignore[misc]
        return (None, True) if done else (dict(zip(self.keys, fields)), False)

    def full_pass(self) -> Iterator[tuple[Any, ...]]:
        for fields in super().full_pass():  # type: ignore[misc]
            yield (dict(zip(self.keys, fields)),)

    def _as_handed(self, fields: tuple[Any, ...]) -> tuple[Any, ...]:
        return (dict(zip(self.keys, fields)),)


class KeyedTensorReader(_Keyed, TensorReader):
    pass


class KeyedWindowReader(_Keyed, WindowReader):
    pass


_KEYED: dict[type, type] = {TensorReader: KeyedTensorReader, WindowReader: KeyedWindowReader}


def keyed(reader: Reader, keys: Any) -> Reader:
    """`reader` giving its batches as ``{key: field}``, one key per field in order."""
    cls = _KEYED.get(type(reader))
    if cls is None:
        raise RunError(
            f"reader: keys name the fields of in-memory data or of windows; a "
            f"{type(reader).__name__} reads a Dataset, whose items give their own keys",
            hint="drop `keys` and have __getitem__ return a dict ({input_ids: ..., labels: ...})",
        )
    n = reader.field_count
    if (not isinstance(keys, list | tuple) or len(keys) != n or len(set(keys)) != n
            or not all(isinstance(k, str) and k for k in keys)):
        raise RunError(
            f"reader: keys must name each of its {n} fields once, got {keys!r}",
            hint="one distinct name per input, in order: in: [x, y], keys: [input_ids, labels]",
        )
    reader.__class__ = cls
    reader.keys = tuple(keys)  # type: ignore[attr-defined]
    reader.field_count = 1
    return reader
