"""9. fsdp: training steps/s of `parallel: fsdp` against a hand-written FSDP2 loop, in
float32 and with `amp: bf16` (FSDP's MixedPrecisionPolicy in bf16, gradients reduced in
float32, float32 output, and autocast, on both sides).

The same model (an MLP 256-512-512-512-10, each Linear its own FSDP unit, then the
root), the same data (the plan's data.synthetic, shuffled each pass, a global batch of
128: 64 per rank), SGD with momentum, 2 gloo processes with one thread each. jobrun runs
a plan whose epoch is one loop of `read` and `train.step`; the hand loop shards the model
the same way (summed gradients: a divide factor of 1) and steps through its slice of
each batch, reading `loss.item()` as a training loop that logs does.

The figures come from the same two processes (started by torchrun): each rank runs the
job through jobrun's runner, as a `jobrun train --replicas 2` rank does, and after each of
its epochs one epoch of the hand loop, on a model of its own that computes the same
numbers (the same initial weights and batches; the losses are checked). From one run to
the next the same program's epochs on this 2-CPU machine sit 10-15% apart (1.13 or
1.31 s), more than the difference measured, and within a run they drift by +-8%; so each
jobrun epoch is compared with the mean of the hand epochs just before and after it (so
that neither side always runs first, and a drift cancels), and the figure is the median
of those ratios. Both sides start an epoch with the ranks together (jobrun's after its
stop agreement, the hand loop's after a barrier). The row also gives the same ratio in
CPU seconds (`cpu_ratio`), which a loaded machine moves far less than wall time. What jobrun adds per step is its global-batch bookkeeping (the ranks'
losses, carried in FSDP's first reduce-scatter of the backward; the stop flags, an
asynchronous all-reduce read a step later), the reader and the executor.

One more row, for information, compares whole processes: `jobrun train --replicas 2`
(its launcher, its spawned workers) against the hand loop started by torchrun, in
alternating runs. It catches what the first rows cannot see (a launcher or worker
process that makes every step slower: workers sharing the terminal's scheduling group
once cost 10-25%), within the run-to-run noise above.

Run as ``python -m torch.distributed.run ... -m benchmarks.bench_fsdp {both,hand} ...`` a
rank does one side or both (see :func:`_rank_main`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    ROOT,
    Mode,
    ReaderBatches,
    Row,
    mlp_plan,
    paired_epochs,
    python_env,
    rank_both,
    rank_exit,
    torchrun,
)

GOAL = 0.95
STEPS = 40  # an epoch's steps; --smoke takes SMOKE_STEPS (it checks that the section runs)
SMOKE_STEPS = 4
SIZES = [256, 512, 512, 512, 10]
N = 5120  # records
BATCH = 128  # the global batch

# Its epoch outputs the last step's loss (loss_last): the hand loop reports the epoch's last loss.
def plan_text(epochs: int, amp: str, steps: int) -> str:
    return mlp_plan("fsdp-bench", n=N, batch=BATCH, sizes=SIZES, steps=steps, head="parallel: fsdp\n",
                    step=", amp: AMP").replace("EPOCHS", str(epochs)).replace("AMP", amp)


class HandFSDP:
    """The plan's training as a hand-written FSDP2 loop, in a process group already
    joined: `epoch()` runs ``steps`` steps and returns their wall time and the last step's
    loss (the global batch's mean, reduced after the timed steps).

    It computes the very numbers the job computes (a tiny model's speed depends on its
    values): the data and the initial weights are made as the plan's init makes them
    (data.synthetic, then model.mlp, from the node's generator), and each pass is read in
    the reader's order (its permutation of the pass, each rank its half of every global
    batch). The section checks that both sides report the same losses.
    """

    def __init__(self, amp: str, steps: int) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        from jobrun.ops.context import OpContext
        from jobrun.ops.data import data_synthetic
        from jobrun.ops.models import model_mlp

        self.torch, self.nn = torch, nn
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ctx = OpContext(node="local", seed=0, device="cpu")
        self.x, self.y = data_synthetic(ctx, task="classification", n=N, features=SIZES[0], classes=SIZES[-1])
        model = model_mlp(ctx, sizes=SIZES)  # a plain nn.Sequential of Linear and ReLU
        dtype = {"null": None, "bf16": torch.bfloat16}[amp]
        reduce = dtype and torch.float32
        # On the CPU: fully_shard's default mesh is on the accelerator where a GPU is.
        mesh = init_device_mesh("cpu", (self.world,))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce))
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce,
                                                                     output_dtype=reduce))
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        self.model, self.dtype, self.steps = model, dtype, steps
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.batches = ReaderBatches(N, BATCH, self.rank, self.world)

    def epoch(self) -> tuple[float, float]:
        torch, model, opt, dtype = self.torch, self.model, self.opt, self.dtype
        cross_entropy = self.nn.functional.cross_entropy
        t0 = time.perf_counter()
        for _ in range(self.steps):
            idx = self.batches.next()
            xb, yb = self.x[idx], self.y[idx]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = cross_entropy(model(xb), yb) * (xb.shape[0] / BATCH)
            loss.backward()
            opt.step()
            loss.item()
        seconds = time.perf_counter() - t0
        last = loss.detach().float().reshape(1)
        self.torch.distributed.all_reduce(last)  # the ranks' weighted parts: the global mean
        return seconds, float(last)


def _rank_main(argv: list[str]) -> None:
    """One rank. ``both ROOT EPOCHS AMP STEPS``: the job through jobrun's runner, one hand
    epoch after each of its epochs (see common.rank_both); ``hand EPOCHS AMP STEPS``: the
    hand loop alone. Rank 0 prints the epoch times as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if argv[0] == "both":
        root, epochs, amp, steps = Path(argv[1]), int(argv[2]), argv[3], int(argv[4])
        out = rank_both(root, plan_text(epochs, amp, steps), lambda: HandFSDP(amp, steps))
    else:
        epochs, amp, steps = int(argv[1]), argv[2], int(argv[3])
        dist.init_process_group("gloo")
        loop_ = HandFSDP(amp, steps)
        out = {"hand": [loop_.epoch()[0] for _ in range(epochs)]}
    rank_exit(out)


def _jobrun(root: Path, epochs: int, amp: str, steps: int) -> list[float]:
    """`jobrun train --replicas 2` of the plan: its epoch times from metrics.jsonl."""
    plan = root / "plan.yaml"
    plan.write_text(plan_text(epochs, amp, steps))
    run = root / "run"
    p = subprocess.run([sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run),
                        "--replicas", "2"], cwd=ROOT, env=python_env(), capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"the fsdp job failed ({p.returncode}): {p.stderr[-2000:]}")
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [e["seconds"] for e in events if e.get("event") == "epoch"]


def run(mode: Mode) -> list[Row]:
    return [_row(mode, "null"), _row(mode, "bf16"), _processes_row(mode)]


def _row(mode: Mode, amp: str) -> Row:
    steps = mode.pick(STEPS, STEPS, SMOKE_STEPS)
    paired = paired_epochs("benchmarks.bench_fsdp", mode.pick(3, 2, 1), mode.pick(12, 6, 2), amp, str(steps))
    bf16 = amp == "bf16"
    return paired.row("fsdp", "parallel: fsdp, amp: bf16 steps/s (2 ranks)" if bf16 else
                      "parallel: fsdp steps/s (2 ranks)", steps, "hand-written FSDP2 loop" + (
                          " (bf16 MixedPrecisionPolicy + autocast)" if bf16 else ""), GOAL,
                      ok=paired.ratio >= GOAL and paired.same_losses)


def _processes_row(mode: Mode) -> Row:
    # Short runs, many of them: a run's epochs move together, so the median needs
    # processes more than epochs.
    reps, epochs = mode.pick(4, 2, 1), mode.pick(4, 3, 2)
    steps = mode.pick(STEPS, STEPS, SMOKE_STEPS)
    ours: list[float] = []
    hand: list[float] = []
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-fsdp-") as tmp:
        for r in range(reps):
            root = Path(tmp) / f"job{r}"
            root.mkdir()
            ours += _jobrun(root, epochs, "null", steps)[1:]
            hand += torchrun("benchmarks.bench_fsdp", "hand", str(epochs), "null", str(steps))["hand"][1:]
    t_ours, t_hand = statistics.median(ours), statistics.median(hand)
    return Row(
        section="fsdp", name="jobrun train --replicas 2, parallel: fsdp steps/s", value=steps / t_ours,
        unit="steps/s", baseline=steps / t_hand, baseline_name="the hand loop started by torchrun",
        ratio=t_hand / t_ours, goal="information (whole processes, +-10% run to run)", ok=None,
        note=f"median epoch of {steps} steps, {reps} runs of {epochs} epochs a side, alternating, first dropped",
        extra={"jobrun_epoch_seconds": ours, "hand_epoch_seconds": hand},
    )


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
