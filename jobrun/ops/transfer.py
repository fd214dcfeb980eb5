"""Batches on their way to the device: what every reader (tensors, Datasets, streams,
token windows) uses to move a batch it read on the host to the run's device.

A reader prepares batch k+1 when it hands out batch k (see "Look-ahead" in
:mod:`jobrun.ops.reader`): it gathers the batch on the host and calls :meth:`ToDevice.send`;
the next `read` hands it out through :meth:`ToDevice.land`.

On a CUDA device `send` copies the batch from pinned host memory with ``non_blocking``
copies issued on a side stream of the reader's, and records an event after them (a tensor
reader gathers its batch straight into pinned memory, :meth:`ToDevice.gather`; a
Dataset's batch is pinned here unless the DataLoader's `pin_memory` pinned it already, in
its own thread); `land` makes the stream that computes wait for that event (the device
waits, not the host) and tells the caching allocator, by ``record_stream``, that this
stream uses the batch, so its memory is not reused while the step still reads it. This is
the prefetcher of NVIDIA's apex ImageNet example (a side stream, ``wait_stream``,
``record_stream``); torch's DataLoader pins in a thread of its own and leaves the copy to
the loop. `train.step` never waits for the device, so the copy of batch k+1 runs while
the GPU computes step k.

Elsewhere (CPU, MPS) `send` copies as ``Tensor.to`` does, without a stream, and `land`
gives back what `send` returned: the same code path, the copy done at once. A batch
already on the device is left as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class _Sent:
    """A batch whose copies were issued on the side stream, and the event after them."""

    __slots__ = ("event", "fields")

    def __init__(self, fields: tuple[Any, ...], event: Any) -> None:
        self.fields = fields
        self.event = event


class ToDevice:
    """Moves batches (tensors, and mappings, lists and tuples of them) to ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream: Any = None  # made at the first copy: CUDA is initialised by then
        self._thread: ThreadPoolExecutor | None = None  # the look-ahead's, made at its first use

    def __call__(self, fields: tuple[Any, ...]) -> tuple[Any, ...]:
        """`fields` on the device, ready for the current stream (a batch used at once)."""
        return self.land(self.send(fields))

    def send(self, fields: tuple[Any, ...]) -> Any:
        """Start moving `fields`; give what this returns to `land` when the batch is used."""
        if not self.cuda:
            return tuple(_move(f, self.device, False) for f in fields)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        # The copies wait for nothing the computing stream does: they read host memory
        # and write new device memory, allocated for this stream.
        with torch.cuda.stream(self._stream):
            out = tuple(_move(f, self.device, True) for f in fields)
        return _Sent(out, self._stream.record_event())

    def gather(self, field: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The records `idx` (along the first dimension) of a host tensor, gathered where
        their copy to the device starts from: on CUDA straight into pinned memory, one
        copy of the batch on the host (gathering, then pinning, made two: 2 x 12.6 MB
        for a batch of 256 images of 3x64x64). The pinned block comes from torch's
        caching host allocator, which reuses it once the copies that read it are done."""
        if self.cuda and field.layout == torch.strided and not field.requires_grad:
            out = torch.empty((len(idx), *field.shape[1:]), dtype=field.dtype, pin_memory=True)
            return torch.index_select(field, 0, idx, out=out)
        return field.index_select(0, idx)

    def submit(self, fn: Any, *args: Any) -> Future:
        """Run ``fn(*args)`` (a reader preparing its next batch: gathering it into pinned
        memory and sending it) on a thread of this device's own, while the calling thread
        goes on launching the step's kernels: one thread, so batches are prepared in the
        order asked. torch releases the GIL while it gathers and copies, so the batch's
        host work (2 ms for 12.6 MB on one core) overlaps the step's launches instead of
        delaying them. The thread's current CUDA device is the caller's (a thread starts
        on device 0), as in the DataLoader's pin-memory thread."""
        if self._thread is None:
            setup: Any = None
            if self.cuda:
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                setup = functools.partial(torch.cuda.set_device, index)
            self._thread = ThreadPoolExecutor(1, "jobrun-look-ahead", initializer=setup)
        return self._thread.submit(fn, *args)

    def land(self, sent: Any) -> tuple[Any, ...]:
        """The fields `send` started moving, usable by the current stream."""
        if not self.cuda:
            return sent
        current = torch.cuda.current_stream(self.device)
        current.wait_event(sent.event)  # the device waits for the copies; the host does not
        for t in _tensors(sent.fields):
            if t.is_cuda:
                t.record_stream(current)  # its memory is not reused before the step used it
        return sent.fields


def _move(value: Any, device: torch.device, staged: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if staged and value.is_cpu and not value.is_pinned():
            value = value.pin_memory()
        return value.to(device, non_blocking=staged)
    if isinstance(value, Mapping):  # a dict, or Hugging Face's BatchEncoding (a UserDict)
        return {k: _move(v, device, staged) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_move(v, device, staged) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []
