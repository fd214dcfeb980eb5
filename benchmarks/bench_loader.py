"""Reading a torch Dataset: jobrun's reader with 2 workers vs a hand loop over a DataLoader.

Both train the same small CNN on the same map-style Dataset (synthetic 16x16 images made
per sample, with a random flip: about 40 us of work a sample), in batches of 64,
shuffled, with two persistent DataLoader workers: jobrun through `reader` and `read`
(whose batch sampler starts at the reader's position and whose workers fetch each batch
under its own seeds), the hand loop through `torch.utils.data.DataLoader(dataset,
batch_size=64, shuffle=True, num_workers=2, persistent_workers=True)` and the usual
zero_grad / forward / backward / step. The figure is steps per second of wall clock (the
workers run beside the training process), epochs interleaved: after each jobrun epoch,
one hand-loop epoch, and the ratio is the median over these pairs (a shared machine's
load drifts; two neighbouring epochs see about the same). The first epoch of each (the
workers start) is not counted.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from benchmarks.common import Mode, Row, median
from benchmarks.inproc import run_plan, write_plan

N, BATCH, WORKERS = 2048, 64, 2
GOAL = 0.95


class Images(Dataset):
    """Sample i: a 1x16x16 image drawn from a generator seeded by i, smoothed, flipped at
    random (torch's default generator, as a transform would), and its label i % 10."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(i)
        image = torch.randn(1, 18, 18, generator=gen)
        image = torch.nn.functional.avg_pool2d(image, 3, stride=1)  # 1x16x16
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return (image - image.mean()) / (image.std() + 1e-6), i % 10


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10),
    )


MODEL = [
    {"target": "torch.nn.Conv2d", "args": [1, 8, 3], "padding": 1},
    {"target": "torch.nn.ReLU"},
    {"target": "torch.nn.MaxPool2d", "args": [2]},
    {"target": "torch.nn.Flatten"},
    {"target": "torch.nn.Linear", "args": [512, 10]},
]


def plan_for(epochs: int) -> dict[str, Any]:
    return {
        "job": "bench-loader",
        "seed": 0,
        "device": "cpu",
        "max_epochs": epochs,
        "init": [{"task": "setup", "do": [
            {"build": {"out": "images", "target": "benchmarks.bench_loader:Images"}},
            {"reader": {"in": "images", "out": "train_data", "batch_size": BATCH, "shuffle": True,
                        "passes": 0, "num_workers": WORKERS, "persistent_workers": True}},
            {"build": {"out": "model", "target": "torch.nn.Sequential", "args": MODEL}},
            {"optimizer": {"in": "model", "out": "opt", "lr": 0.05, "momentum": 0.9}},
        ]}],
        "epoch": [{"task": "train", "do": [
            {"loop": None, "do": [
                {"read": {"in": "train_data", "out": ["xb", "yb", "end"]}},
                {"stop_if": "end"},
                {"train.step": {"in": ["model", "opt", "xb", "yb"], "out": "loss"}},
            ]},
            {"log": {"in": ["loss"]}},
        ]}],
    }


class HandLoop:
    """The same training over a plain DataLoader of the same Dataset."""

    def __init__(self) -> None:
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.loader = torch.utils.data.DataLoader(
            Images(), batch_size=BATCH, shuffle=True, num_workers=WORKERS, persistent_workers=True,
            generator=torch.Generator().manual_seed(0),
        )
        self.losses: list[float] = []

    def run_epoch(self) -> float:
        """One epoch; its wall-clock seconds."""
        F = torch.nn.functional
        model, opt = self.model, self.opt
        t0 = time.perf_counter()
        loss = None
        for xb, yb in self.loader:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        self.losses.append(loss.item() if loss is not None else float("nan"))
        return time.perf_counter() - t0

    def close(self) -> None:
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()


def run(mode: Mode) -> list[Row]:
    torch.set_num_threads(1)
    epochs = mode.pick(9, 5, 2)
    reps = mode.pick(4, 2, 1)
    steps = -(-N // BATCH)
    ratios: list[float] = []
    jobrun_s: list[float] = []
    hand_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-loader-") as tmp:
        tmpd = Path(tmp)
        plan_path = write_plan(plan_for(epochs), tmpd)
        for _ in range(reps):
            hand = HandLoop()
            times: list[float] = []
            run_dir = tmpd / "run"
            if run_dir.exists():
                shutil.rmtree(run_dir)

            def between(epoch: int, hand: HandLoop = hand, times: list[float] = times) -> None:
                times.append(hand.run_epoch())  # after each jobrun epoch, outside its time

            try:
                job = run_plan(plan_path, run_dir=run_dir, between=between)
            finally:
                hand.close()
            ours = [e.seconds for e in job][1:]  # the first epoch starts the workers
            theirs = times[1:]
            jobrun_s += ours
            hand_s += theirs
            ratios += [h / j for j, h in zip(ours, theirs)]
    ratio = median(ratios)
    return [Row(
        section="loader", name="Dataset, 2 workers steps/s", value=steps / median(jobrun_s),
        unit="steps/s", baseline=steps / median(hand_s), baseline_name="hand loop over a DataLoader",
        ratio=ratio, goal=f"jobrun/hand >= {GOAL}", ok=ratio >= GOAL,
        note=f"{N} samples, batch {BATCH}, {WORKERS} persistent workers, {steps} steps/epoch; "
        f"wall clock of {epochs - 1} epochs x {reps} reps, interleaved",
        extra={"ratio_per_epoch_pair": ratios},
    )]
