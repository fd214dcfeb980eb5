"""11. gpu (``run.py --device cuda``): training steps/s of a small GPT-shaped model on one
CUDA GPU, bf16 autocast, against a hand-written loop of the same model and data, and the
host syncs per step; then large image batches, where the reader's look-ahead is measured
on and off (:mod:`benchmarks.gpu_images`).

The model: token embedding + learned positions, 4 pre-norm transformer blocks (d 256,
4 heads, causal), a linear head over a vocabulary of 1024; sequences of 128 tokens, a
batch of 32, AdamW. jobrun runs a plan whose epoch is one loop of `read` and
`train.step` (`amp: bf16`, device cuda); the hand loop reads the same batches (the
reader's order) from a pinned host tensor, copies them non_blocking and steps with
autocast, reading the epoch's mean loss only at the end of the epoch. Both run in this process,
epochs alternating (one hand epoch after each of jobrun's); an epoch ends when its last
loss is read, so the GPU has finished it. The figure is the median of hand/jobrun over
adjacent epochs. Host syncs: the calls that read a tensor's value to the host
(`Tensor.item`, `tolist`, `__float__`, `__bool__`, ...) of a GPU tensor during jobrun's
epochs, per step.

Measured on an H200 (benchmarks/README.md, section 12); `benchmarks/gpu.sh` runs it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import gpu_images
from benchmarks.common import Mode, ReaderBatches, Row, close_losses, loop_plan

GOAL = 0.98
STEPS = 100
N, T, VOCAB = 2048, 128, 1024  # sequences, tokens a sequence, vocabulary
BATCH = 32

PLAN = loop_plan("gpu-bench", [
    'call: {fn: "benchmarks.bench_gpu:tokens", out: [x, y]}',
    f"reader: {{in: [x, y], out: data, batch_size: {BATCH}, shuffle: true, passes: 0}}",
    'build: {out: model, target: "benchmarks.bench_gpu:TinyGPT"}',
    "optimizer: {in: model, out: opt, target: torch.optim.AdamW, lr: 0.0003}",
], STEPS, head="device: cuda\n", step=", amp: bf16", outputs="[loss]")


def tokens() -> tuple[Any, Any]:
    """Token sequences (inputs, and the same shifted by one as targets), on the host."""
    import torch

    seq = torch.randint(0, VOCAB, (N, T + 1), generator=torch.Generator().manual_seed(0))
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _model_class() -> Any:
    import torch
    from torch import nn

    class TinyGPT(nn.Module):
        def __init__(self, d: int = 256, heads: int = 4, layers: int = 4) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.zeros(T, d))
            block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, VOCAB)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x) + self.pos[: x.shape[1]]
            h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
            return self.head(self.norm(h))

    return TinyGPT


def __getattr__(name: str) -> Any:  # the plan's `build` imports TinyGPT (torch imported then)
    if name == "TinyGPT":
        return _model_class()
    raise AttributeError(name)


class HandLoop:
    """The plan's training by hand: the same initial weights (built as `build` builds
    them, from the node's generator), the same batches in the same order."""

    def __init__(self) -> None:
        import torch

        from jobrun.ops.context import OpContext
        from jobrun.ops.models import build

        self.torch = torch
        x, y = tokens()
        self.x, self.y = x.pin_memory(), y.pin_memory()
        ctx = OpContext(node="local", seed=0, device="cuda")
        self.model = build(ctx, target="benchmarks.bench_gpu:TinyGPT")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.0003)
        self.batches = ReaderBatches(N, BATCH)

    def epoch(self) -> tuple[float, float]:
        torch, model, opt = self.torch, self.model, self.opt
        cross_entropy = torch.nn.functional.cross_entropy
        t0 = time.perf_counter()
        losses = []
        for _ in range(STEPS):
            idx = self.batches.next()
            xb = self.x[idx].pin_memory().cuda(non_blocking=True)
            yb = self.y[idx].pin_memory().cuda(non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(xb)
                loss = cross_entropy(logits.reshape(-1, VOCAB), yb.reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        # The epoch's mean loss, as jobrun's epoch outputs give it (one sum at the end);
        # reading it waits for the epoch's kernels.
        mean = torch.stack(losses).sum().item() / STEPS
        return time.perf_counter() - t0, mean


_EPOCH_END = 4  # reads an epoch's end may make: its outputs for the records and the stop check
_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


class _HostReads:
    """Counts the calls that read a GPU tensor's value to the host while active (a read of
    a host tensor, such as the step count AdamW keeps on the CPU, waits for nothing)."""

    def __init__(self) -> None:
        import torch

        self.torch, self.count, self.active = torch, 0, False
        self._real = {name: getattr(torch.Tensor, name) for name in _READS}
        for name, real in self._real.items():
            setattr(torch.Tensor, name, self._counted(real))

    def _counted(self, real: Any) -> Any:
        def counted(t: Any, *args: Any, **kwargs: Any) -> Any:
            if self.active and t.device.type != "cpu":
                self.count += 1
            return real(t, *args, **kwargs)

        return counted

    def restore(self) -> None:
        for name, real in self._real.items():
            setattr(self.torch.Tensor, name, real)


def _image_rows(mode: Mode, reads: _HostReads) -> list[Row]:
    """Large host batches, the look-ahead on and off (:mod:`benchmarks.gpu_images`); a
    failure there is one MISS row with its traceback printed, and the GPT rows stay."""
    try:
        return gpu_images.rows(mode, reads)
    except Exception as e:  # noqa: BLE001 - one GPU run must keep what it measured
        traceback.print_exc()
        return [Row(section="gpu", name="image batches: FAILED", value=0.0, unit="-", baseline=1.0,
                    baseline_name="-", ratio=0.0, goal="runs", ok=False, note=f"{type(e).__name__}: {e}")]


def run(mode: Mode) -> list[Row]:
    import torch

    from benchmarks.inproc import metrics, run_plan

    if not torch.cuda.is_available():
        raise RuntimeError("the gpu section needs a CUDA GPU (run.py --device cuda)")
    epochs = mode.pick(15, 9, 2)
    hand: list[tuple[float, float]] = []
    loop: list[HandLoop] = []
    reads = _HostReads()
    per_epoch: list[int] = []  # reads in each of jobrun's epochs after the first

    def between(epoch: int) -> None:
        if reads.active:
            per_epoch.append(reads.count)
        reads.active = False
        if not loop:
            loop.append(HandLoop())
        hand.append(loop[0].epoch())
        reads.count, reads.active = 0, True

    try:
        with tempfile.TemporaryDirectory(prefix="jobrun-bench-gpu-") as tmp:
            plan = Path(tmp) / "plan.yaml"
            plan.write_text(PLAN.replace("EPOCHS", str(epochs)))
            ours = [e.seconds for e in run_plan(plan, Path(tmp) / "run", between, device="cuda")]
            losses = [e["outputs"]["train"]["loss"] for e in metrics(Path(tmp) / "run") if e.get("event") == "epoch"]
        reads.active = False
        images = _image_rows(mode, reads)
    finally:
        reads.restore()
    # Each epoch ends by reading its outputs (the loss, for metrics.jsonl and the stop
    # check): a few reads an epoch, none per step.
    per_step = sum(per_epoch) / (STEPS * max(1, len(per_epoch)))
    ours, times = ours[1:], [t for t, _ in hand][1:]
    ratio = statistics.median(h / o for o, h in zip(ours, times))
    same = close_losses(losses, [loss for _, loss in hand])
    name = torch.cuda.get_device_name()
    return [
        Row(section="gpu", name=f"GPT-shaped model, bf16 steps/s ({name})", value=STEPS / statistics.median(ours),
            unit="steps/s", baseline=STEPS / statistics.median(times), baseline_name="hand-written loop",
            ratio=ratio, goal=f"jobrun/hand >= {GOAL}", ok=ratio >= GOAL and same,
            note=f"{STEPS} steps an epoch, {epochs} epochs a side alternating, first dropped",
            extra={"jobrun_epoch_seconds": ours, "hand_epoch_seconds": times, "same_losses": same}),
        Row(section="gpu", name="host syncs per step (jobrun)", value=per_step, unit="reads/step",
            baseline=1.0, baseline_name="one loss.item() a step", ratio=per_step,
            goal="0 per step (a few at an epoch's end)", ok=bool(per_epoch) and max(per_epoch) <= _EPOCH_END,
            note=f"reads of tensor values in each of jobrun's epochs of {STEPS} steps, first dropped",
            extra={"reads_per_epoch": per_epoch}),
        *images,
    ]
