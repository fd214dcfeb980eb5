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
batches; the losses are checked). The figure is the median over pairs of adjacent
epochs of hand/jobrun. What jobrun adds per step is its reader, its executor, the loss
carried in DDP's first bucket, the stop flags' asynchronous all-reduce and the weighting
of each rank's loss by its share of the global batch.

Run as ``python -m torch.distributed.run ... -m benchmarks.bench_ddp ROOT EPOCHS``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Mode, Row, python_env, reader_order

GOAL = 0.97
STEPS = 16
SIZES = [256, 1536, 1536, 1536, 10]
N = 4096  # records
BATCH = 128  # the global batch

PLAN = f"""
job: ddp-bench
seed: 0
max_epochs: EPOCHS
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: classification, n: {N}, features: {SIZES[0]}, classes: {SIZES[-1]}}}
      - reader: {{in: [x, y], out: data, batch_size: {BATCH}, shuffle: true, passes: 0}}
      - model.mlp: {{out: model, sizes: {SIZES}}}
      - optimizer: {{in: model, out: opt, lr: 0.01, momentum: 0.9}}
epoch:
  - task: train
    do:
      - loop: {STEPS}
        do:
          - read: {{in: data, out: [xb, yb, end]}}
          - if: end
            then: [{{read: {{in: data, out: [xb, yb, end]}}}}]
          - train.step: {{in: [model, opt, xb, yb], out: loss}}
    outputs: [loss_last]                 # the last step's, as the hand loop reads it
"""


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
        self.steps = 0
        self.order: Any = None

    def epoch(self) -> tuple[float, float]:
        model, opt = self.model, self.opt
        cross_entropy = self.torch.nn.functional.cross_entropy
        t0 = time.perf_counter()
        for _ in range(STEPS):
            lo = self.steps * BATCH % N
            if lo == 0:  # a pass's order, as the shuffled reader makes it
                self.order = reader_order(N, self.steps * BATCH // N)
            self.steps += 1
            idx = self.order[lo:lo + BATCH].chunk(self.world)[self.rank]
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
    """One rank: the job through jobrun's runner, one hand epoch after each of its
    epochs. Rank 0 prints the epoch times and losses as JSON."""
    import torch
    import torch.distributed as dist

    from benchmarks.inproc import metrics, run_plan
    from jobrun.runner import group

    torch.set_num_threads(1)
    root, epochs = Path(argv[0]), int(argv[1])
    group.start("cpu")  # as a `jobrun train --replicas 2` rank joins its group
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = root / "plan.yaml"
    if rank == 0:
        plan.write_text(PLAN.replace("EPOCHS", str(epochs)))
    dist.barrier()
    hand: list[tuple[float, float]] = []
    loop: list[HandDDP] = []

    def between(epoch: int) -> None:
        if not loop:  # built outside jobrun's epochs (it draws no random numbers)
            loop.append(HandDDP())
        hand.append(loop[0].epoch())

    ours = [e.seconds for e in run_plan(plan, root / "run", between, rank=rank, world_size=world)]
    if rank == 0:
        losses = [e["outputs"]["train"]["loss_last"] for e in metrics(root / "run") if e.get("event") == "epoch"]
        print(json.dumps({"jobrun": ours, "hand": [t for t, _ in hand], "jobrun_loss": losses,
                          "hand_loss": [loss for _, loss in hand]}), flush=True)
    group.finish()
    sys.stderr.flush()
    os._exit(0)  # without the interpreter's teardown (see bench_fsdp._rank_main)


def _torchrun(*args: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "benchmarks.bench_ddp", *args], cwd=ROOT, env=python_env(),
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"the ddp ranks failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(mode: Mode) -> list[Row]:
    reps, epochs = mode.pick(3, 1, 1), mode.pick(8, 5, 2)
    ours: list[float] = []
    hand: list[float] = []
    same_losses = True
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-ddp-") as tmp:
        for r in range(reps):
            root = Path(tmp) / f"both{r}"
            root.mkdir()
            got = _torchrun(str(root), str(epochs))
            ours += got["jobrun"][1:]  # the first epoch of each side warms up
            hand += got["hand"][1:]
            same_losses &= len(got["jobrun_loss"]) == len(got["hand_loss"]) == epochs and all(
                abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(got["jobrun_loss"], got["hand_loss"]))
    ratio = statistics.median(h / o for o, h in zip(ours, hand))
    return [Row(
        section="ddp", name="parallel: ddp steps/s (2 ranks, 20 MB of gradients)", value=STEPS / statistics.median(ours),
        unit="steps/s", baseline=STEPS / statistics.median(hand),
        baseline_name="hand-written DistributedDataParallel loop", ratio=ratio,
        goal=f"jobrun/hand >= {GOAL}", ok=ratio >= GOAL and same_losses,
        note=f"{STEPS} steps an epoch, epochs alternating in the same 2 processes, {reps} runs of {epochs} "
             "epochs a side, first dropped; ratio: median over pairs of adjacent epochs",
        extra={"jobrun_epoch_seconds": ours, "hand_epoch_seconds": hand, "same_losses": same_losses,
               "ratio_of_medians": statistics.median(hand) / statistics.median(ours)},
    )]


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
