"""10. ddp: training steps/s of `--replicas 2` (`parallel: ddp`, torch's DDP) against a
hand-written DistributedDataParallel loop, on CPU/gloo.

The same model (an MLP 256-1536-1536-1536-10: 5.1 M parameters, 20 MB of float32
gradients all-reduced every step, so that the all-reduce is a visible part of it), the
same data (the plan's data.synthetic, shuffled each pass, a global batch of 128: 64 per
rank), SGD with momentum, 2 gloo processes with one thread each. jobrun runs a plan whose
epoch is one loop of `read` and `train.step`; the hand loop wraps its model in
`DistributedDataParallel` (default buckets and hook) and steps through its slice of each
batch, reading the loss only at the end of the epoch, as a loop that logs once does.

As in the fsdp section (see bench_fsdp.py for why), the figures come from the same two
processes started by torchrun: each rank runs the job through jobrun's runner, as a
`jobrun train --replicas 2` rank does, and after each of its epochs one epoch of the hand
loop, on a model of its own that computes the same numbers (the same initial weights and
batches; the losses are checked). The figure is the median over jobrun's epochs of
hand/jobrun, each against the hand epochs around it. What jobrun adds per step is its reader, its executor, the loss
carried in DDP's first bucket, the stop flags' asynchronous all-reduce and the weighting
of each rank's loss by its share of the global batch.

Run as ``python -m torch.distributed.run ... -m benchmarks.bench_ddp both ROOT EPOCHS``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks.common import (
    Mode,
    ReaderBatches,
    Row,
    mlp_plan,
    paired_epochs,
    rank_both,
    rank_exit,
)

GOAL = 0.97
STEPS = 16
SIZES = [256, 1536, 1536, 1536, 10]
N = 4096  # records
BATCH = 128  # the global batch

# Its epoch outputs the last step's loss (loss_last), as the hand loop reads it.
PLAN = mlp_plan("ddp-bench", n=N, batch=BATCH, sizes=SIZES, steps=STEPS)


class HandDDP:
    """The plan's training as a hand-written DistributedDataParallel loop, in a process
    group already joined: `epoch()` runs STEPS steps and returns their wall time and the
    last step's loss (the global batch's mean, reduced after the timed steps). Its data,
    initial weights and batches are the job's (see bench_fsdp.HandFSDP)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from jobrun.ops.context import OpContext
        from jobrun.ops.data import data_synthetic
        from jobrun.ops.models import model_mlp

        self.torch = torch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ctx = OpContext(node="local", seed=0, device="cpu")  # one process: a plain module
        self.x, self.y = data_synthetic(ctx, task="classification", n=N, features=SIZES[0], classes=SIZES[-1])
        self.model = DistributedDataParallel(model_mlp(ctx, sizes=SIZES))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.batches = ReaderBatches(N, BATCH, self.rank, self.world)

    def epoch(self) -> tuple[float, float]:
        model, opt = self.model, self.opt
        cross_entropy = self.torch.nn.functional.cross_entropy
        t0 = time.perf_counter()
        for _ in range(STEPS):
            idx = self.batches.next()
            xb, yb = self.x[idx], self.y[idx]
            opt.zero_grad(set_to_none=True)
            loss = cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        seconds = time.perf_counter() - t0
        last = loss.detach().reshape(1) / self.world
        self.torch.distributed.all_reduce(last)  # the ranks' means: the global mean
        return seconds, float(last)


def _rank_main(argv: list[str]) -> None:
    """One rank, ``both ROOT EPOCHS``: the job through jobrun's runner, one hand epoch
    after each of its epochs (see common.rank_both)."""
    import torch

    torch.set_num_threads(1)
    root, epochs = Path(argv[1]), int(argv[2])
    rank_exit(rank_both(root, PLAN.replace("EPOCHS", str(epochs)), HandDDP))


def run(mode: Mode) -> list[Row]:
    paired = paired_epochs("benchmarks.bench_ddp", mode.pick(3, 1, 1), mode.pick(8, 5, 2))
    return [paired.row("ddp", "parallel: ddp steps/s (2 ranks, 20 MB of gradients)", STEPS,
                       "hand-written DistributedDataParallel loop", GOAL,
                       ok=paired.ratio >= GOAL and paired.same_losses)]


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
