"""Ops bound to one call site: `train.step` and `read` specialised once, when the code
generator knows their arguments (jobrun.runner.codegen_task binds every op that has a
``bind``).

Between torch's kernels a bytecode costs about 20 ns (cold caches, mispredicted dispatch),
and the checks of train.step's and read's arguments ran at every step though the plan
fixes them: about 200 bytecodes a step, which the runner row measured as 1.5% of a tiny
MLP's step (benchmarks/README.md, session 9; `benchmarks/instructions.py --bytecodes`
counts them). A bound op takes the inputs only. It runs the plain case's lines after a
test of its inputs, and hands anything else to the op's function, the meaning; a call
site that is not the plain case is not bound (`bind` gives None).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from jobrun.ops.context import OpContext

_Tensor = torch.Tensor
_Optimizer = torch.optim.Optimizer
_LONG = torch.long
_FLOAT32 = torch.float32


def bind_step(ctx: OpContext, loss: str = "cross_entropy", clip_grad_norm: float | None = None,
              accumulate: int = 1, amp: str | None = None) -> Any:
    """`train.step` with one process, one micro-batch, no amp and no clip, and a loss by
    name: zero_grad, forward, loss, backward, step, as train_step's plain case, for a batch
    of tensors on the run's device. None for any other call site."""
    from jobrun.ops import train
    from jobrun.ops.losses import LOSSES, MODEL

    if not (ctx.world_size == 1 and accumulate.__class__ is int and accumulate == 1
            and amp is None and clip_grad_norm is None and loss in LOSSES and loss != MODEL):
        return None
    loss_fn, general, last = LOSSES[loss], train.train_step, train._last_loss
    cross_entropy = loss == "cross_entropy"  # its common case here, not through its wrapper
    on_cpu, device = ctx.device == "cpu", _indexed(torch.device(ctx.device))

    def step(model: Any, opt: Any, x: Any, y: Any = train._ONE_BATCH) -> Any:
        if (x.__class__ is _Tensor and y.__class__ is _Tensor and isinstance(opt, _Optimizer)
                and ((x.is_cpu and y.is_cpu) if on_cpu else (x.device == device and y.device == device))):
            shape = y.shape
            if shape and shape[0]:
                opt.zero_grad(set_to_none=True)
                pred = model(x)
                value = F.cross_entropy(pred, y) if (cross_entropy and y.dtype is _LONG and pred.__class__
                                                     is _Tensor and pred.ndim == 2) else loss_fn(pred, y)
                value.backward()
                opt.step()
                last[0] = value  # as train_step keeps it
                mean = value.data
                return mean if mean.dtype is _FLOAT32 else mean.float()
        return general(ctx, model, opt, x, y, loss=loss)

    return step


def _indexed(device: torch.device) -> torch.device:
    """The device a tensor on `device` reports: `cuda` in one process is torch's current
    GPU (`cuda:0` unless set), `mps` is `mps:0`; a bare `cuda` never equals a tensor's."""
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device.type, 0) if device.index is None and device.type == "mps" else device


def bind_read(ctx: OpContext, _out_names: tuple[str, ...] = (), _done_tested: bool = False) -> Any:
    """`read` of a reader of tensors (whose fields are known when it is made) into its
    fields and `done`: the batch as the reader gives it, its wait counted in the run's feed
    as read_op counts it. Any other reader (a Dataset's, whose fields a read tells), or a
    read that leaves `done` out (it rolls over a pass's end), goes through read_op. Either
    way it returns one value per output, so the generated line does not count them."""
    from jobrun.ops.reader import read_op
    from jobrun.ops.tensor_reader import TensorReader
    from jobrun.runner.codegen_runtime import results

    progress = ctx.progress
    feed = progress.get("feed") if progress is not None else None
    outputs = len(_out_names)
    if feed is None or outputs < 2:  # one output: a reader's one field, rolling over
        return None
    fields = outputs - 1  # the reader's fields, then done
    clock = time.perf_counter

    def read(reader: Any) -> Any:
        if reader.__class__ is TensorReader and reader.field_count == fields:
            t0 = clock()
            with reader.lock:
                batch = reader.read()
                reader.tally[2] += clock() - t0
                if reader.feed is not feed:
                    feed.watch(reader)
            return batch
        return results(read_op(ctx, reader, _out_names, _done_tested), outputs)

    read.counted = True  # type: ignore[attr-defined]
    return read
