"""Where the runner row's epoch goes: the MLP example's jobrun epoch cut into pieces, each
timed inside the running job (caches as cold as in the benchmark), beside the same pieces
of the loop that calls jobrun's ops directly (bench_runner.HandLoop with ops=True).

    python benchmarks/epoch_split.py [--tiny] [--reps 8]

Pieces, in the order an epoch runs them:
  loop       the epoch's start to `evaluate`: the training loop (jobrun: less its mean loss)
  mean loss  jobrun's mean of the loop's losses (codegen_runtime.loss_mean)
  evaluate   the evaluation pass
  after      `evaluate` returned to the epoch's end (jobrun: `ge`, `log`, the task's
             outputs, the runner's stop test and samples/s; the ops loop: its JSON line)
and, inside jobrun's `after`: `log` and three of its parts (the metrics line, TensorBoard's
list, the values made plain) and the runner's samples/s (EpochRates.finish). Nothing is
timed inside the loop's steps (a timer there costs a few us a step itself). Medians over
the epochs of `--reps` jobs (6 epochs each, the first a warm-up); after each jobrun epoch
one epoch of the ops loop and one of the hand loop, in turns, as the runner row runs them;
torch on one thread.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ns = time.perf_counter_ns
PIECES = ("loop", "mean loss", "evaluate", "after")
PARTS = ("log", "metrics line", "tensorboard", "plain values", "samples/s")


class Marks:
    """Times of one epoch: named instants, and durations summed by name."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}
        self.spent: dict[str, int] = collections.defaultdict(int)
        self.epochs: list[dict[str, float]] = []

    def mark(self, name: str) -> None:
        self.at.setdefault(name, ns())

    def timed(self, owner: Any, attr: str, name: str, marks: tuple[str, str] | None = None) -> None:
        """Wrap owner.attr: its time adds up under `name`; `marks` names its start and end."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if marks:
                self.mark(marks[0])
            t0 = ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += ns() - t0
                if marks:
                    self.mark(marks[1])

        setattr(owner, attr, wrapper)

    def epoch_done(self) -> None:
        a, spent = self.at, self.spent
        row = {"loop": (a["evaluate<"] - a["epoch"] - spent["mean loss"]) / 1e3,
               "evaluate": (a["evaluate>"] - a["evaluate<"]) / 1e3,
               "after": (a["end"] - a["evaluate>"]) / 1e3}
        self.epochs.append({**{k: v / 1e3 for k, v in spent.items()}, **row})
        self.at, self.spent = {}, collections.defaultdict(int)


def main() -> None:
    import torch

    import jobrun.ops.core as core
    import jobrun.runner.codegen_runtime as runtime
    import jobrun.runner.codegen_task as codegen_task
    import jobrun.runner.records as records
    import jobrun.runner.throughput as throughput
    from benchmarks import inproc
    from benchmarks.bench_runner import HandLoop, plan_for

    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--tiny", action="store_true", help="the runner row's tiny MLP (default: the MLP example)")
    args.add_argument("--reps", type=int, default=8)
    opts = args.parse_args()
    torch.set_num_threads(1)
    sizes, batch = ([4, 8, 2], 8) if opts.tiny else ([16, 64, 64, 4], 64)
    job, ops = Marks(), Marks()

    # jobrun: the ops the plan calls are wrapped as the code generator takes them
    resolve = codegen_task.resolve_impl

    def resolve_timed(spec: Any) -> Any:
        impl = resolve(spec)
        name = getattr(impl, "__name__", "")
        holder = type("Holder", (), {"fn": staticmethod(impl)})
        if name == "evaluate":
            job.timed(holder, "fn", "evaluate", ("evaluate<", "evaluate>"))
        elif name == "log":
            job.timed(holder, "fn", "log")
        return holder.fn

    codegen_task.resolve_impl = resolve_timed
    job.timed(records.Metrics, "write", "metrics line")
    job.timed(records.TensorBoard, "write", "tensorboard")
    job.timed(core, "plain", "plain values")
    job.timed(throughput.EpochRates, "finish", "samples/s")
    job.timed(runtime, "loss_mean", "mean loss")
    status, epoch_line = inproc._Capture.status, inproc._Capture.epoch_line

    def on_status(self: Any, what: str) -> None:
        status(self, what)
        if what.startswith("epoch "):
            job.at, job.spent = {}, collections.defaultdict(int)
            job.mark("epoch")

    def on_epoch_line(self: Any, result: Any, *a: Any, **k: Any) -> None:
        job.mark("end")
        job.epoch_done()
        epoch_line(self, result, *a, **k)

    inproc._Capture.status, inproc._Capture.epoch_line = on_status, on_epoch_line

    # the ops loop: HandLoop's own epoch, with the same instants marked
    from jobrun.ops.reader import read_op
    from jobrun.ops.train import evaluate, train_step

    def ops_epoch(self: HandLoop) -> tuple[float, float]:
        import json

        ops.mark("epoch")
        self.epoch += 1
        loss: Any = 0.0
        while True:
            xb, yb, end = read_op(self.ctx, self.reader)
            if end:
                break
            loss = train_step(self.ctx, self.model, self.opt, xb, yb)
        ops.mark("evaluate<")
        val_loss, accuracy = evaluate(self.ctx, self.model, self.val_reader)
        ops.mark("evaluate>")
        loss = float(loss)
        self.log.write(json.dumps({"epoch": self.epoch, "values": {
            "loss": loss, "val_loss": val_loss, "accuracy": accuracy, "done": accuracy >= 2.0}}) + "\n")
        self.log.flush()
        ops.mark("end")
        ops.epoch_done()
        return 0.0, 0.0

    with tempfile.TemporaryDirectory(prefix="jobrun-epoch-split-") as tmp:
        tmpd = Path(tmp)
        plan = inproc.write_plan(plan_for(sizes, batch, 6), tmpd)
        for rep in range(opts.reps):
            loop = HandLoop(sizes, batch, tmpd / "ops.jsonl", ops=True)
            hand = HandLoop(sizes, batch, tmpd / "hand.jsonl")

            def between(epoch: int, loop: HandLoop = loop, hand: HandLoop = hand) -> None:
                # as the runner row: the hand loop's epoch too, the order alternating
                for run in (lambda: ops_epoch(loop), hand.run_epoch)[:: 1 if epoch % 2 else -1]:
                    run()

            inproc.run_plan(plan, run_dir=tmpd / f"run{rep}", between=between)
            del job.epochs[-6], ops.epochs[-6]  # each job's first epoch warms up

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    print(f"sizes {sizes}, batch {batch}: us an epoch (medians of {len(job.epochs)} epochs)")
    print(f"{'piece':14s} {'jobrun':>9s} {'ops loop':>9s} {'jobrun - ops':>13s}")
    total = 0.0
    for piece in PIECES:
        j, o = median(job.epochs, piece), median(ops.epochs, piece)
        total += j - o
        print(f"{piece:14s} {j:9.1f} {o:9.1f} {j - o:+13.1f}")
    print(f"{'all':14s} {'':9s} {'':9s} {total:+13.1f}")
    print("inside jobrun's pieces:")
    for part in PARTS:
        print(f"  {part:12s} {median(job.epochs, part):9.1f}")


if __name__ == "__main__":
    main()
