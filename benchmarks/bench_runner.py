"""1. Runner overhead: a job trained by jobrun vs the same training in a hand-written loop.

Both run in this process, on one torch thread, alternating, on the same data (made by
the same generator), the same batches (a fresh shuffle per pass, batch `batch`, the last
short batch kept), the same model (an nn.Sequential of Linear/ReLU, SGD with momentum)
and the same per-epoch work (one training pass, an evaluation pass over the validation
set in batches of 256, the `done` test and one log line). jobrun's epoch time is the
runner's own (EpochResult.seconds); the loop's is timed the same way, around one epoch.
The first epoch of each repetition is a warm-up and is not counted. A second copy of the
hand loop runs beside them: the row's statistic applied to two identical loops (`aa_ratio`)
says how far apart this run's noise puts programs that do the same work.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Mode, Row, median, reader_order
from benchmarks.inproc import metrics, run_plan, write_plan

N_TRAIN, N_VAL = 2048, 512
GOAL = 0.98


def plan_for(sizes: list[int], batch: int, epochs: int) -> dict[str, Any]:
    features, classes = sizes[0], sizes[-1]
    data = {"task": "classification", "n": N_TRAIN, "features": features, "classes": classes,
            "noise": 1.5, "seed": 0}
    return {
        "job": "bench-runner",
        "seed": 0,
        "device": "cpu",
        "vars": {"lr": 0.1, "batch": batch},
        "max_epochs": epochs,
        "stop_when": ["done"],
        "init": [{"task": "setup", "do": [
            {"data.synthetic": {"out": ["x", "y"], **data}},
            {"data.synthetic": {"out": ["vx", "vy"], **data, "n": N_VAL, "sample_seed": 1}},
            {"reader": {"in": ["x", "y"], "out": "train_data", "batch_size": "${batch}",
                        "shuffle": True, "passes": 0}},
            {"reader": {"in": ["vx", "vy"], "out": "val_data", "batch_size": 256}},
            {"model.mlp": {"out": "model", "sizes": sizes}},
            {"optimizer": {"in": "model", "out": "opt", "lr": "${lr}", "momentum": 0.9}},
            {"const": {"out": "loss", "value": 0.0}},
        ]}],
        "epoch": [{"task": "train", "do": [
            {"loop": None, "do": [
                {"read": {"in": "train_data", "out": ["xb", "yb", "end"]}},
                {"stop_if": "end"},
                {"train.step": {"in": ["model", "opt", "xb", "yb"], "out": "loss"}},
            ]},
            {"evaluate": {"in": ["model", "val_data"], "out": ["val_loss", "accuracy"]}},
            # never true: every repetition runs all its epochs
            {"ge": {"in": ["accuracy", 2.0], "out": "done"}},
            {"log": {"in": ["loss_last", "val_loss", "accuracy"]}},  # the hand loops' is the last
        ], "outputs": ["loss", "accuracy", "done"]}],
    }


class HandLoop:
    """The same training as `plan_for`, written as a plain torch loop.

    Same data (the same generator), same initial weights (the model is built the way
    `model.mlp` builds it, from the node's seeded generator), same batches (the reader's
    shuffle of each pass), so both trajectories are the same numbers: a tiny model's
    speed depends on its values (denormals), and this keeps that out of the ratio.
    With ``ops=True`` the loop calls jobrun's op functions instead (read, train.step,
    evaluate): the difference to jobrun is then the executor's and runner's own cost.
    """

    def __init__(self, sizes: list[int], batch: int, log_path: Path, ops: bool = False):
        import torch
        import torch.nn.functional as F

        from jobrun.ops.context import OpContext
        from jobrun.ops.data import data_synthetic
        from jobrun.ops.models import model_mlp, optimizer
        from jobrun.ops.reader import reader_op
        from jobrun.ops.train import train_step

        self.torch, self.F = torch, F
        ctx = self.ctx = OpContext(node="local", seed=0, device="cpu")
        kw = {"task": "classification", "features": sizes[0], "classes": sizes[-1],
              "noise": 1.5, "seed": 0}
        self.x, self.y = data_synthetic(ctx, n=N_TRAIN, **kw)
        self.vx, self.vy = data_synthetic(ctx, n=N_VAL, sample_seed=1, **kw)
        self.ops = ops
        if ops:
            self.reader = reader_op(ctx, self.x, self.y, batch_size=batch, shuffle=True, passes=0)
            self.val_reader = reader_op(ctx, self.vx, self.vy, batch_size=256)
        self.model = model_mlp(ctx, sizes=sizes)
        if ops:
            self.opt = optimizer(ctx, self.model, lr=0.1, momentum=0.9)
            self.train_step = train_step
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.batch = batch
        self.log = log_path.open("a")
        self.epoch = 0
        self.losses: list[float] = []

    def run_epoch(self) -> tuple[float, float]:
        """One epoch; (wall seconds, CPU seconds)."""
        t0, c0 = time.perf_counter(), time.process_time()
        self.epoch += 1
        loss, val_loss, accuracy = self._ops_epoch() if self.ops else self._hand_epoch()
        done = accuracy >= 2.0
        self.log.write(json.dumps({"epoch": self.epoch, "values": {
            "loss": loss, "val_loss": val_loss, "accuracy": accuracy, "done": done}}) + "\n")
        self.log.flush()
        self.losses.append(loss)
        return time.perf_counter() - t0, time.process_time() - c0

    def _hand_epoch(self) -> tuple[float, float, float]:
        torch, F = self.torch, self.F
        model, opt, x, y, b = self.model, self.opt, self.x, self.y, self.batch
        order = reader_order(len(x), self.epoch - 1)  # the job's batches: the loss check proves it
        loss = 0.0
        for start in range(0, len(x), b):
            idx = order[start:start + b]
            xb, yb = x[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            out = F.cross_entropy(model(xb), yb)
            out.backward()
            opt.step()
            loss = out.item()
        model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(self.vx), 256):
                vxb, vyb = self.vx[start:start + 256], self.vy[start:start + 256]
                pred = model(vxb)
                loss_sum += F.cross_entropy(pred, vyb, reduction="sum").item()
                correct += int((pred.argmax(dim=-1) == vyb).sum())
        model.train()
        return loss, loss_sum / len(self.vx), correct / len(self.vx)

    def _ops_epoch(self) -> tuple[float, float, float]:
        from jobrun.ops.reader import read_op
        from jobrun.ops.train import evaluate

        ctx, model, opt, reader, train_step = self.ctx, self.model, self.opt, self.reader, self.train_step
        loss = 0.0
        while True:
            xb, yb, end = read_op(ctx, reader)
            if end:
                break
            loss = train_step(ctx, model, opt, xb, yb)
        val_loss, accuracy = evaluate(ctx, model, self.val_reader)
        return float(loss), val_loss, accuracy


def _steps_per_epoch(batch: int) -> int:
    return -(-N_TRAIN // batch)


def measure(mode: Mode, label: str, sizes: list[int], batch: int) -> Row:
    import torch

    from benchmarks.inproc import metrics

    torch.set_num_threads(1)
    # Few epochs, many repetitions: the spread is between repetitions (each builds new
    # models, optimizers and data: their memory layout moves a tiny model's speed by a
    # few %), not between the epochs of one.
    epochs = mode.pick(6, 4, 2)
    reps = mode.pick(13, 5, 1)
    steps = _steps_per_epoch(batch)
    cpu: dict[str, list[float]] = {"jobrun": [], "hand": [], "ops": [], "hand2": []}
    wall: dict[str, list[float]] = {"jobrun": [], "hand": [], "ops": [], "hand2": []}
    ratios, op_ratios, aa_ratios = [], [], []
    same_losses = True
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-runner-") as tmp:
        tmpd = Path(tmp)
        plan_path = write_plan(plan_for(sizes, batch, epochs), tmpd)
        for _ in range(reps):
            hand = HandLoop(sizes, batch, tmpd / "hand.jsonl")
            ops = HandLoop(sizes, batch, tmpd / "ops.jsonl", ops=True)
            # A second hand loop, the same program: how far the row's statistic puts two
            # identical loops apart in this run (its noise floor, `aa_ratio`).
            hand2 = HandLoop(sizes, batch, tmpd / "hand2.jsonl")
            times: dict[str, list[tuple[float, float]]] = {"hand": [], "ops": [], "hand2": []}

            def between(epoch: int, loops=(("hand", hand), ("ops", ops), ("hand2", hand2)),
                        times=times) -> None:
                # After every jobrun epoch, one epoch of each loop (the order rotates):
                # all of them see the same noise of the shared machine.
                k = epoch % len(loops)
                for name, loop in loops[k:] + loops[:k]:
                    times[name].append(loop.run_epoch())

            run_dir = tmpd / "run"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            job = run_plan(plan_path, run_dir=run_dir, between=between)
            for loop in (hand, ops, hand2):
                loop.log.close()
            logged = [r["values"]["loss_last"] for r in metrics(run_dir) if "values" in r]
            same_losses &= all(
                abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(logged, hand.losses)
            ) and hand2.losses == hand.losses
            got = {"jobrun": [(e.seconds, e.cpu) for e in job], **times}
            for name, rows in got.items():
                cpu[name] += [c for _, c in rows[1:]]  # the first epoch is a warm-up
                wall[name] += [w for w, _ in rows[1:]]
            j = median([c for _, c in got["jobrun"][1:]])
            ratios.append(median([c for _, c in got["hand"][1:]]) / j)
            op_ratios.append(median([c for _, c in got["ops"][1:]]) / j)
            aa_ratios.append(median([c for _, c in got["hand"][1:]]) / median([c for _, c in got["hand2"][1:]]))
    ratio = median(ratios)
    sps = {k: steps / median(v) for k, v in cpu.items()}
    return Row(
        section="runner", name=f"{label} steps/s", value=sps["jobrun"], unit="steps/s",
        baseline=sps["hand"], baseline_name="hand-written torch loop", ratio=ratio,
        goal=f"jobrun/hand >= {GOAL}", ok=ratio >= GOAL,
        note=f"sizes {sizes}, batch {batch}, {steps} steps/epoch; CPU time of "
        f"{epochs - 1} epochs x {reps} reps, interleaved; two identical hand loops measure "
        f"{median(aa_ratios):.3f} apart (the noise floor)",
        extra={
            "ratio_per_rep": ratios,
            "overhead_us_per_step": (1 / sps["jobrun"] - 1 / sps["hand"]) * 1e6,
            "ops_loop_steps_per_s": sps["ops"],
            "jobrun_vs_ops_loop": median(op_ratios),
            # hand/hand2 by the row's own statistic: 1.0 but for the machine's noise
            "aa_ratio": median(aa_ratios),
            "aa_ratio_per_rep": aa_ratios,
            "executor_overhead_us_per_step": (1 / sps["jobrun"] - 1 / sps["ops"]) * 1e6,
            "ops_overhead_us_per_step": (1 / sps["ops"] - 1 / sps["hand"]) * 1e6,
            "wall_ratio": median(wall["hand"]) / median(wall["jobrun"]),
            "same_losses": same_losses,
        },
    )


def installed_loggers() -> list[str]:
    """csv, and the trackers whose packages are installed (the optional extras)."""
    import importlib.util

    return ["csv"] + [name for name in ("mlflow", "wandb") if importlib.util.find_spec(name)]


def measure_loggers(mode: Mode, sizes: list[int], batch: int) -> Row:
    """The MLP example with every installed logger against the same job without any, the
    two alternating (CPU time of the epochs, as `measure`); goal: >= GOAL of its steps/s."""
    import os

    import torch

    os.environ.setdefault("WANDB_SILENT", "true")
    torch.set_num_threads(1)
    epochs = mode.pick(8, 6, 2)
    reps = mode.pick(7, 4, 1)
    steps = _steps_per_epoch(batch)
    loggers = installed_loggers()
    cpu: dict[str, list[float]] = {"plain": [], "loggers": []}
    ratios = []
    same_losses = True
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-loggers-") as tmp:
        tmpd = Path(tmp)
        plain = write_plan(plan_for(sizes, batch, epochs), tmpd)
        logged = write_plan({**plan_for(sizes, batch, epochs), "loggers": loggers}, tmpd, "loggers.yaml")
        for rep in range(reps):
            got = {}
            for name, path in [("plain", plain), ("loggers", logged)][::1 if rep % 2 else -1]:
                # A new directory each time: MLflow keeps its SQLite engine per path in
                # this process, which a file deleted under it would make read-only.
                run_dir = tmpd / f"run-{name}-{rep}"
                job = run_plan(path, run_dir=run_dir)
                got[name] = [e.cpu for e in job[1:]]  # the first epoch is a warm-up
                cpu[name] += got[name]
                got[f"{name} losses"] = [r["values"]["loss_last"] for r in metrics(run_dir) if "values" in r]
            ratios.append(median(got["plain"]) / median(got["loggers"]))
            same_losses &= got["plain losses"] == got["loggers losses"]  # loggers change nothing
    sps = {k: steps / median(v) for k, v in cpu.items()}
    ratio = median(ratios)
    return Row(
        section="runner", name="MLP example, every logger steps/s",
        value=sps["loggers"], unit="steps/s", baseline=sps["plain"],
        baseline_name="the same job without loggers", ratio=ratio, goal=f"loggers/plain >= {GOAL}",
        ok=ratio >= GOAL,
        note=f"loggers {', '.join(loggers)}; sizes {sizes}, batch {batch}; CPU time of "
        f"{epochs - 1} epochs x {reps} reps, alternating (wandb's service process not counted)",
        extra={"ratio_per_rep": ratios, "loggers": loggers, "same_losses": same_losses},
    )


def measure_profile(mode: Mode) -> Row:
    """--profile's cost per timed plan step: the dispatch section's plan (a loop of `add`,
    one timed op an iteration) with and without the profile, alternating."""
    from benchmarks import bench_dispatch

    n = mode.pick(100_000, 50_000, 20_000)
    epochs = mode.pick(4, 3, 2)
    reps = mode.pick(7, 5, 1)
    per_op: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[Any]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-profile-") as tmp:
        tmpd = Path(tmp)
        plan_path = write_plan(bench_dispatch.plan_for(n, epochs), tmpd)
        for rep in range(reps):
            for profile in (False, True) if rep % 2 else (True, False):
                run_dir = tmpd / f"run-{profile}-{rep}"
                job = run_plan(plan_path, run_dir=run_dir, profile=profile)
                per_op[profile].append(median([e.cpu for e in job[1:]]) / n * 1e6)
                outputs[profile].append([r["outputs"] for r in metrics(run_dir) if r.get("event") == "epoch"])
    on, off = median(per_op[True]), median(per_op[False])
    overhead = median([a - b for a, b in zip(per_op[True], per_op[False])])
    return Row(
        section="runner", name="add in a plan loop, --profile", value=on, unit="us/op",
        baseline=off, baseline_name="the same without --profile", ratio=on / off,
        goal="information (the overhead per timed plan step: value - baseline)", ok=None,
        note=f"loop: {n} adds, one timed op an iteration; CPU time, {epochs - 1} epochs x "
        f"{reps} reps, alternating; overhead {overhead:.3f} us per timed plan step",
        extra={"overhead_us_per_step": overhead, "us_per_op_on": per_op[True],
               "us_per_op_off": per_op[False], "same_losses": outputs[True] == outputs[False]},
    )


def run(mode: Mode) -> list[Row]:
    return [
        measure(mode, "MLP example", [16, 64, 64, 4], 64),
        measure(mode, "tiny MLP", [4, 8, 2], 8),
        measure_loggers(mode, [16, 64, 64, 4], 64),
        measure_profile(mode),
    ]
