"""Batches on their way to the device: what every reader (tensors, Datasets, streams)
uses to move a batch it read on the host to the run's device.

On a CUDA device a batch is copied from pinned host memory (pinned here unless the
DataLoader's `pin_memory` pinned it already, in its own thread) with ``non_blocking``
copies issued on a side stream of the reader's; the stream that computes waits for that
stream, not the host. `train.step` never waits for the device, so the host reads batch
k+1 while the GPU still runs step k, and the copy overlaps that step's kernels: the
next batch is on its way while the step runs. Elsewhere (CPU, MPS) the same function
copies as ``Tensor.to`` does, without a stream; a batch already on the device is left as
it is.
"""

from __future__ import annotations

from typing import Any

import torch


class ToDevice:
    """Moves batches (tensors, and dicts, lists and tuples of them) to ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream: Any = None  # made at the first copy: CUDA is initialised by then

    def __call__(self, fields: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.cuda:
            return tuple(_move(f, self.device, False) for f in fields)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            out = tuple(_move(f, self.device, True) for f in fields)
        current.wait_stream(self._stream)  # the device waits for the copies; the host does not
        for t in _tensors(out):
            if t.is_cuda:
                t.record_stream(current)  # its memory is not reused before the step used it
        return out


def _move(value: Any, device: torch.device, staged: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if staged and value.is_cpu and not value.is_pinned():
            value = value.pin_memory()
        return value.to(device, non_blocking=staged)
    if isinstance(value, dict):
        return {k: _move(v, device, staged) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_move(v, device, staged) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []
