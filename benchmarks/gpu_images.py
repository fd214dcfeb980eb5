"""The gpu section's image rows: does the reader's look-ahead gain where a batch's copy
to the device is a visible part of a step?

Large host batches: float32 images of 3x64x64, 256 a batch (12.6 MB), 4096 of them (201
MB) in an ordinary (pageable) host tensor, with integer labels, read shuffled by a tensor
reader; a small conv net (4 convolutions, 64 to 512 channels, stride 2 from the second,
ReLU, average pool, a linear head over 10 classes), SGD with momentum, float32. Sides,
epochs in turns in this process, each on a model of its own built from the same seed,
all reading the same batches in the same order (the reader's) and computing the same
numbers (the losses are checked):

- jobrun, a plan whose epoch is a loop of `read` and `train.step`, its epochs taking
  turns: the look-ahead as it is (when `read` hands out a batch, the reader's thread
  gathers the next one into pinned memory and issues its copy on a side stream while
  this thread launches the step), then switched off for the next epoch
  (:class:`LookAhead`: the reader's `_prepare` does nothing, so each `read` gathers and
  sends its own batch, still pinned and non_blocking, when it runs), and so on;
- hand loops (:class:`HandLoop`): NAIVE, ``x[idx].to(device)``, blocking, from pageable
  memory (the loop waits for the device at every copy); AHEAD, NVIDIA apex's prefetcher
  (the next batch gathered into pinned memory and copied non_blocking on a side stream
  when the current one is handed out, its event waited for by the computing stream,
  ``record_stream``); THREAD, the same done by a thread of its own (as jobrun's reader
  does, and a DataLoader's pin-memory thread).

All of it twice: as above, and with the loss read every step (the plan `call`s
:func:`value`, the hand loops call it too), where nothing runs ahead of the device.
Figures: jobrun (look-ahead on) / THREAD; look-ahead on / off (the question: the
standard says a fast path shows its gain or goes); jobrun / NAIVE (information: what
pinned, non_blocking copies are worth); THREAD / AHEAD (information); host syncs per
step; and in the note what a batch costs, measured apart (its gather into pinned memory,
its copy, the naive gather and blocking copy) and each hand loop's step. On the CPU
(tests/test_bench_gpu_images.py) the same code runs at a tiny size, without streams,
and checks that every side computes the same numbers bit for bit.
"""

from __future__ import annotations

import queue
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import ReaderBatches, close_losses, loop_plan

STEPS = 80  # steps an epoch


@dataclass(frozen=True)
class Size:
    n: int  # images
    batch: int
    side: int  # height = width
    width: int  # channels of the first convolution


GPU = Size(n=4096, batch=256, side=64, width=64)  # 12.6 MB a batch, 201 MB of images
TINY = Size(n=24, batch=4, side=8, width=4)  # the CPU test's


def images(n: int, side: int) -> tuple[Any, Any]:
    """`n` random images of 3 x side x side (float32) and their labels, on the host."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


def _model_class() -> Any:
    from torch import nn

    class ConvNet(nn.Module):
        def __init__(self, width: int = 64, classes: int = 10) -> None:
            super().__init__()
            c = width
            self.net = nn.Sequential(
                nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
                nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(2 * c, 4 * c, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(4 * c, 8 * c, 3, stride=2, padding=1), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * c, classes),
            )

        def forward(self, x: Any) -> Any:
            return self.net(x)

    return ConvNet


def __getattr__(name: str) -> Any:  # the plan's `build` imports ConvNet (torch imported then)
    if name == "ConvNet":
        return _model_class()
    raise AttributeError(name)


def plan(size: Size, steps: int) -> str:
    return loop_plan("gpu-images", [
        f'call: {{fn: "benchmarks.gpu_images:images", out: [x, y], n: {size.n}, side: {size.side}}}',
        f"reader: {{in: [x, y], out: data, batch_size: {size.batch}, shuffle: true, passes: 0}}",
        f'build: {{out: model, target: "benchmarks.gpu_images:ConvNet", width: {size.width}}}',
        "optimizer: {in: model, out: opt, lr: 0.01, momentum: 0.9}",
    ], steps, head="device: DEVICE\n")


# The hand loops: how each gets its batches.
NAIVE, AHEAD, THREAD = "naive", "ahead", "thread"


class HandLoop:
    """The plan's training by hand: the same initial weights (built as `build` builds them
    after the job's ``torch.manual_seed(0)``), the same batches in the same order, each
    had by `kind`: NAIVE (``x[idx].to(device)``, blocking, from pageable memory), AHEAD
    (the look-ahead's pattern: the next batch gathered into pinned memory and its copy
    issued on a side stream when the current one is handed out) or THREAD (the same, done
    by a thread of its own while this one launches the steps, as a DataLoader's pin-memory
    thread works). ``sync``: the loss is read every step, as a loop printing it does."""

    def __init__(self, size: Size, device: str, data: tuple[Any, Any], kind: str, sync: bool = False) -> None:
        import torch

        from jobrun.ops.context import OpContext
        from jobrun.ops.models import build

        self.torch, self.device, self.kind, self.sync = torch, torch.device(device), kind, sync
        self.cuda = self.device.type == "cuda"
        self.x, self.y = data  # the plan's images, made alike
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = build(OpContext(node="local", seed=0, device=device),
                               target="benchmarks.gpu_images:ConvNet", width=size.width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.batches = ReaderBatches(size.n, size.batch)
        self.stream = torch.cuda.Stream(self.device) if self.cuda and kind != NAIVE else None
        self.ahead: Any = None
        self.losses: list[float] = []
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True) if kind == THREAD else None
        if self._thread is not None:
            self._thread.start()

    def _send(self, idx: Any) -> Any:
        """The records `idx` gathered into pinned memory, their copy issued on the side
        stream; an event after it."""
        torch = self.torch
        host = [torch.index_select(f, 0, idx, out=torch.empty((len(idx), *f.shape[1:]), dtype=f.dtype,
                                                               pin_memory=self.cuda))
                for f in (self.x, self.y)]
        if self.stream is None:
            return [f.to(self.device) for f in host], None
        with torch.cuda.stream(self.stream):
            sent = [f.to(self.device, non_blocking=True) for f in host]
        return sent, self.stream.record_event()

    def _land(self, sent: Any) -> Any:
        fields, event = sent
        if event is not None:
            current = self.torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in fields:
                t.record_stream(current)
        return fields

    def _feed(self) -> None:
        """THREAD's thread: batches sent in order, one waiting in the queue."""
        while not self._stop.is_set():
            sent = self._send(self.batches.next())
            while not self._stop.is_set():
                try:
                    self._queue.put(sent, timeout=0.05)
                    break
                except queue.Full:
                    continue

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def _batch(self) -> Any:
        if self.kind == NAIVE:  # pageable memory, blocking
            idx = self.batches.next()
            return self.x[idx].to(self.device), self.y[idx].to(self.device)
        if self.kind == THREAD:
            return self._land(self._queue.get())
        sent = self.ahead if self.ahead is not None else self._send(self.batches.next())
        self.ahead = self._send(self.batches.next())  # prepared while this step runs
        return self._land(sent)

    def epoch(self, steps: int) -> float:
        """Seconds of `steps` steps, ending when the device has finished them."""
        model, opt = self.model, self.opt
        cross_entropy = self.torch.nn.functional.cross_entropy
        t0 = time.perf_counter()
        for _ in range(steps):
            xb, yb = self._batch()
            opt.zero_grad(set_to_none=True)
            loss = cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            if self.sync:
                value(loss)
        self.losses.append(loss.item())  # waits for the epoch's kernels
        return time.perf_counter() - t0


def value(loss: Any) -> float:
    """The loss read to the host (the sync variant's plan calls this every step)."""
    return loss.item()


class LookAhead:
    """Switches jobrun's look-ahead off and on in this process (the benchmark's switch,
    not the user's): while off, a reader's `_prepare` does nothing, so every `read`
    gathers and sends its own batch when it runs. Counts the preparations made and
    skipped (so a run can tell the switch took effect)."""

    def __init__(self) -> None:
        from jobrun.ops.reader import Reader

        self.on, self.prepared, self.skipped = True, 0, 0
        self._real = real = Reader._prepare
        switch = self

        def prepare(reader: Any, at: int, fn: Any, *args: Any) -> None:
            if switch.on:
                switch.prepared += 1
                real(reader, at, fn, *args)
            else:
                switch.skipped += 1

        Reader._prepare = prepare  # type: ignore[method-assign]

    def restore(self) -> None:
        from jobrun.ops.reader import Reader

        Reader._prepare = self._real  # type: ignore[method-assign]


@dataclass
class Measured:
    """Epoch seconds of each side (first epochs included), the losses at each epoch's end."""

    on: list[float] = field(default_factory=list)  # jobrun's epochs 1, 3, 5...
    off: list[float] = field(default_factory=list)  # jobrun's epochs 2, 4, 6...
    hand: dict[str, list[float]] = field(default_factory=dict)  # by kind
    losses: dict[str, list[float]] = field(default_factory=dict)
    prepared: dict[str, int] = field(default_factory=dict)  # preparations made/skipped
    reads: list[int] = field(default_factory=list)  # host reads of GPU tensors, each jobrun epoch


def measure(size: Size, device: str, epochs: int, steps: int = STEPS, reads: Any = None,
            sync: bool = False, data: Any = None) -> Measured:
    """`epochs` of jobrun's epochs (look-ahead on in the odd ones, off in the even ones),
    each followed by one epoch of each hand loop (their order turning). `reads`: a
    counter of host reads (bench_gpu's), active during jobrun's epochs. ``sync``: the
    plan and the hand loops read the loss every step."""
    from benchmarks.inproc import run_plan

    got = Measured()
    data = data if data is not None else images(size.n, size.side)
    loops = {kind: HandLoop(size, device, data, kind, sync) for kind in (NAIVE, AHEAD, THREAD)}
    got.hand = {kind: [] for kind in loops}
    switch = LookAhead()
    counts = {"on": 0, "off_skipped": 0, "off_prepared": 0}

    def between(epoch: int) -> None:
        if reads is not None:
            got.reads.append(reads.count)
            reads.active = False
        if switch.on:
            counts["on"] += switch.prepared
        else:
            counts["off_skipped"] += switch.skipped
            counts["off_prepared"] += switch.prepared
        kinds = list(loops)
        for kind in kinds[epoch % 3:] + kinds[:epoch % 3]:  # each goes first in turn
            got.hand[kind].append(loops[kind].epoch(steps))
        switch.on = epoch % 2 == 0  # the next epoch: off after an odd one
        switch.prepared = switch.skipped = 0
        if reads is not None:
            reads.count, reads.active = 0, True

    text = plan(size, steps).replace("EPOCHS", str(epochs)).replace("DEVICE", device)
    if sync:
        step = "          - train.step: {in: [model, opt, xb, yb], out: loss}\n"
        assert step in text
        text = text.replace(step, step + '          - call: {fn: "benchmarks.gpu_images:value", in: [loss]}\n')
    try:
        with tempfile.TemporaryDirectory(prefix="jobrun-bench-images-") as tmp:
            path = Path(tmp) / "plan.yaml"
            path.write_text(text)
            if reads is not None:
                reads.count, reads.active = 0, True
            epochs_run = run_plan(path, Path(tmp) / "run", between, device=device)
    finally:
        switch.restore()
        for loop in loops.values():
            loop.close()
        if reads is not None:
            reads.active = False
    ours = [e.seconds for e in epochs_run]
    got.on, got.off = ours[0::2], ours[1::2]
    jobrun = [float(e.outputs["train"]["loss_last"]) for e in epochs_run]  # type: ignore[index]
    got.losses = {"jobrun": jobrun, **{kind: loop.losses for kind, loop in loops.items()}}
    got.prepared = counts
    return got


def _costs(size: Size, device: str, data: tuple[Any, Any]) -> dict[str, float]:
    """Milliseconds a batch costs, medians of 20: its gather into pinned memory, the copy
    of that to the device, and the naive gather + blocking copy from pageable memory."""
    import torch

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = data[0]
    batches = ReaderBatches(size.n, size.batch)
    times: dict[str, list[float]] = {"gather_pinned_ms": [], "copy_pinned_ms": [], "naive_gather_copy_ms": []}
    for _ in range(20):
        idx = batches.next()
        sync()
        t0 = time.perf_counter()
        host = torch.index_select(x, 0, idx, out=torch.empty((len(idx), *x.shape[1:]), pin_memory=cuda))
        t1 = time.perf_counter()
        host.to(device, non_blocking=cuda)
        sync()
        t2 = time.perf_counter()
        x[idx].to(device)
        sync()
        t3 = time.perf_counter()
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(seconds)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def _pairs(subject: list[float], baseline: list[float]) -> list[float]:
    """Speed ratios subject/baseline of paired epochs (baseline time / subject time)."""
    return [b / s for s, b in zip(subject, baseline)]


def rows(mode: Any, reads: Any, device: str = "cuda", size: Size = GPU, steps: int = STEPS) -> list[Any]:
    """The section's image rows (bench_gpu.run calls this on the GPU; the test, on the CPU
    at a tiny size): the plan as it is, then with the loss read every step. `reads`:
    bench_gpu's counter of host reads."""
    data = images(size.n, size.side)
    costs = _costs(size, device, data)
    epochs = mode.pick(16, 10, 4)  # even: as many epochs on as off
    out = []
    for sync in (False, True):
        got = measure(size, device, epochs, steps, reads=None if sync else reads, sync=sync, data=data)
        out += _rows(got, size, device, steps, epochs, costs, sync)
    return out


def _rows(got: Measured, size: Size, device: str, steps: int, epochs: int, costs: dict[str, float],
          sync: bool) -> list[Any]:
    import torch

    from benchmarks.common import Row

    # The first epoch of each side warms up (cudnn's choice of algorithms, pinned memory).
    # Each jobrun epoch with the look-ahead is paired with the hand epochs right after it
    # and with the next jobrun epoch (look-ahead off).
    on, off = got.on[1:], got.off[1:]
    after_on = {kind: times[2::2] for kind, times in got.hand.items()}
    vs_thread, vs_naive = _pairs(on, after_on[THREAD]), _pairs(on, after_on[NAIVE])
    on_off = _pairs(on, off)
    thread_ahead = _pairs(got.hand[THREAD][1:], got.hand[AHEAD][1:])
    med = statistics.median
    same = all(close_losses(got.losses[k], got.losses["jobrun"]) for k in got.hand)
    switched = got.prepared["on"] > 0 and got.prepared["off_skipped"] > 0 == got.prepared["off_prepared"]
    step_ms = {kind: 1000 * med(times[1:]) / steps for kind, times in got.hand.items()}
    mb = size.batch * 3 * size.side ** 2 * 4 / 1e6
    where = torch.cuda.get_device_name() if device == "cuda" else device
    what = "image batches, loss read every step" if sync else "image batches"
    note = (f"{steps} steps an epoch, {epochs} jobrun epochs (look-ahead on, off, on...), each followed by "
            "one epoch of each hand loop, first of each side dropped; ratios: medians over adjacent epochs. "
            f"A batch: gather into pinned memory {costs['gather_pinned_ms']:.2f} ms, its copy "
            f"{costs['copy_pinned_ms']:.2f} ms; naive gather + blocking copy {costs['naive_gather_copy_ms']:.2f} "
            f"ms; a step of the hand loops: " + ", ".join(f"{k} {v:.2f} ms" for k, v in step_ms.items()))
    extra = {"sync_every_step": sync, "on_epoch_seconds": got.on, "off_epoch_seconds": got.off,
             "hand_epoch_seconds": got.hand, "losses": got.losses, "same_losses": same,
             "prepared": got.prepared, "batch_costs_ms": costs, "hand_step_ms": step_ms,
             "pairs": {"jobrun_vs_thread": vs_thread, "on_vs_off": on_off, "jobrun_vs_naive": vs_naive,
                       "thread_vs_ahead": thread_ahead}}
    speed = steps / med(on)
    out = [
        Row(section="gpu", name=f"{what} ({size.batch}x3x{size.side}x{size.side} float32, {mb:.1f} MB) "
                               f"steps/s ({where})",
            value=speed, unit="steps/s", baseline=steps / med(got.hand[THREAD][1:]),
            baseline_name="hand loop with the same look-ahead (a thread)", ratio=med(vs_thread),
            goal="jobrun/hand >= 0.98", ok=med(vs_thread) >= 0.98 and same, note=note, extra=extra),
        Row(section="gpu", name=f"{what}: look-ahead on / off", value=speed, unit="steps/s",
            baseline=steps / med(off), baseline_name="look-ahead switched off", ratio=med(on_off),
            goal="on/off >= 1.02 (a gain, or the look-ahead goes)", ok=med(on_off) >= 1.02 and switched,
            note="on: the next batch gathered into pinned memory and sent on the reader's thread while the "
                 "step is launched; off: each read gathers and sends its own batch when it runs",
            extra={"switched": switched, "pairs": on_off}),
        Row(section="gpu", name=f"{what}: jobrun / naive hand loop", value=speed, unit="steps/s",
            baseline=steps / med(got.hand[NAIVE][1:]), baseline_name="x[idx].to(device): pageable, blocking",
            ratio=med(vs_naive), goal="information (what pinned, non_blocking copies are worth)", ok=None,
            extra={"pairs": vs_naive}),
        Row(section="gpu", name=f"{what}: hand look-ahead in a thread / in the loop",
            value=steps / med(got.hand[THREAD][1:]), unit="steps/s", baseline=steps / med(got.hand[AHEAD][1:]),
            baseline_name="hand loop, look-ahead in the loop", ratio=med(thread_ahead),
            goal="information (what preparing batches in a thread would add)", ok=None,
            extra={"pairs": thread_ahead}),
    ]
    if not sync:
        per_step = sum(got.reads[1:]) / (steps * max(1, len(got.reads) - 1))
        out.append(Row(section="gpu", name="host syncs per step (image batches, jobrun)", value=per_step,
                       unit="reads/step", baseline=1.0, baseline_name="one loss.item() a step", ratio=per_step,
                       goal="0 per step (a few at an epoch's end)",
                       ok=len(got.reads) > 1 and max(got.reads[1:]) <= 4, extra={"reads_per_epoch": got.reads}))
    return out
