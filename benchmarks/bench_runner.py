"""1. Runner overhead: a job trained by jobrun vs the same training in a hand-written loop.

Both run in this process, on one torch thread, alternating, on the same data (made by
the same generator), the same batches (a fresh shuffle per pass, batch `batch`, the last
short batch kept), the same model (an nn.Sequential of Linear/ReLU, SGD with momentum)
and the same per-epoch work (one training pass, an evaluation pass over the validation
set in batches of 256, the `done` test and one log line). jobrun's epoch time is the
runner's own (EpochResult.seconds); the loop's is timed the same way, around one epoch.
The first epoch of each repetition is a warm-up and is not counted.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Mode, Row, alternate, median, paired_ratio
from benchmarks.inproc import run_plan, write_plan

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
            {"log": {"in": ["loss", "val_loss", "accuracy"]}},
        ], "outputs": ["loss", "accuracy", "done"]}],
    }


class HandLoop:
    """The same training as `plan_for`, written as a plain torch loop."""

    def __init__(self, sizes: list[int], batch: int, log_path: Path):
        import torch
        import torch.nn.functional as F
        from torch import nn

        from jobrun.ops.context import OpContext
        from jobrun.ops.train import data_synthetic

        self.torch, self.F = torch, F
        ctx = OpContext(device="cpu")
        kw = {"task": "classification", "features": sizes[0], "classes": sizes[-1],
              "noise": 1.5, "seed": 0}
        self.x, self.y = data_synthetic(ctx, n=N_TRAIN, **kw)
        self.vx, self.vy = data_synthetic(ctx, n=N_VAL, sample_seed=1, **kw)
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.model = nn.Sequential(*layers)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.batch = batch
        self.gen = torch.Generator().manual_seed(0)
        self.log = log_path.open("a")
        self.epoch = 0

    def run_epoch(self) -> float:
        torch, F = self.torch, self.F
        model, opt, x, y, b = self.model, self.opt, self.x, self.y, self.batch
        t0 = time.perf_counter()
        self.epoch += 1
        order = torch.randperm(len(x), generator=self.gen)
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
        accuracy = correct / len(self.vx)
        done = accuracy >= 2.0
        self.log.write(json.dumps({"epoch": self.epoch, "values": {
            "loss": loss, "val_loss": loss_sum / len(self.vx), "accuracy": accuracy}}) + "\n")
        self.log.flush()
        _ = done
        return time.perf_counter() - t0


def _steps_per_epoch(batch: int) -> int:
    return -(-N_TRAIN // batch)


def measure(mode: Mode, label: str, sizes: list[int], batch: int) -> Row:
    import torch

    torch.set_num_threads(1)
    epochs = mode.pick(12, 6, 2)
    reps = mode.pick(9, 5, 1)
    steps = _steps_per_epoch(batch)
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-runner-") as tmp:
        tmpd = Path(tmp)
        plan_path = write_plan(plan_for(sizes, batch, epochs), tmpd)

        def jobrun_rep() -> float:
            secs = run_plan(plan_path)
            return steps / median(secs[1:])

        def hand_rep() -> float:
            loop = HandLoop(sizes, batch, tmpd / "hand.jsonl")
            secs = [loop.run_epoch() for _ in range(epochs)]
            loop.log.close()
            return steps / median(secs[1:])

        jobrun_sps, hand_sps = alternate(reps, jobrun_rep, hand_rep)
    ratio = paired_ratio(jobrun_sps, hand_sps)
    return Row(
        section="runner", name=f"{label} steps/s", value=median(jobrun_sps), unit="steps/s",
        baseline=median(hand_sps), baseline_name="hand-written torch loop", ratio=ratio,
        goal=f"jobrun/hand >= {GOAL}", ok=ratio >= GOAL,
        note=f"sizes {sizes}, batch {batch}, {steps} steps/epoch, {epochs - 1} timed epochs x {reps} reps",
        extra={"jobrun_steps_per_s": jobrun_sps, "hand_steps_per_s": hand_sps,
               "overhead_us_per_step": (1 / median(jobrun_sps) - 1 / median(hand_sps)) * 1e6},
    )


def run(mode: Mode) -> list[Row]:
    return [
        measure(mode, "MLP example", [16, 64, 64, 4], 64),
        measure(mode, "tiny MLP", [4, 8, 2], 8),
    ]
