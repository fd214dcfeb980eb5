"""On a CUDA GPU: readers move batches through pinned memory on a side stream, and a
steady-state train.step never waits for the device (torch's sync debug mode raises on
any synchronising call). Skipped without a GPU; benchmarks/gpu.sh runs them."""

from __future__ import annotations

import pytest
import torch

from jobrun.ops import models, train
from jobrun.ops.context import OpContext
from jobrun.ops.reader import read_op, reader_op

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_a_tensor_reader_gives_the_cpu_batches_on_the_gpu():
    x, y = _data()
    on_cpu = reader_op(OpContext(device="cpu"), x, y, batch_size=16, shuffle=True)
    on_gpu = reader_op(OpContext(device="cuda"), x, y, batch_size=16, shuffle=True)
    for _ in range(4):
        a, b = read_op(None, on_cpu), read_op(None, on_gpu)
        assert b[0].is_cuda and b[1].is_cuda and not a[0].is_cuda
        assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())
    assert on_gpu._to_device._stream is not None  # copied on the reader's side stream


def test_a_dataset_reader_gives_the_cpu_batches_on_the_gpu():
    from torch.utils.data import TensorDataset

    x, y = _data()
    ds = TensorDataset(x, y)
    on_cpu = reader_op(OpContext(device="cpu"), ds, batch_size=16)
    on_gpu = reader_op(OpContext(device="cuda"), ds, batch_size=16)
    for _ in range(4):
        a, b = read_op(None, on_cpu), read_op(None, on_gpu)
        assert b[0].is_cuda and torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_steady_state_steps_never_wait_for_the_device(amp):
    ctx = OpContext(device="cuda", seed=1)
    x, y = _data(256)
    model = models.model_mlp(ctx, sizes=[8, 64, 3])
    opt = models.optimizer(ctx, model, lr=0.1, momentum=0.9)
    reader = reader_op(ctx, x, y, batch_size=32, shuffle=True, passes=0)
    losses = []
    for step in range(12):
        if step == 2:  # after the first steps (CUDA and cuBLAS set up, the optimizer's state made)
            torch.cuda.set_sync_debug_mode("error")
        try:
            xb, yb, done = read_op(ctx, reader)
            if not done:
                losses.append(train.train_step(ctx, model, opt, xb, yb, amp=amp))
        finally:
            if step == 11:
                torch.cuda.set_sync_debug_mode("default")
    assert all(loss.is_cuda and loss.dim() == 0 for loss in losses)
    assert torch.stack(losses).isfinite().all().item()


def test_a_compiled_model_on_the_gpu_trains_and_keeps_its_keys():
    ctx = OpContext(device="cuda", seed=1)
    x, y = _data()
    model = models.model_mlp(ctx, sizes=[8, 16, 3], compile=True)
    opt = models.optimizer(ctx, model, lr=0.1)
    first = train.train_step(ctx, model, opt, x.cuda(), y.cuda()).item()
    for _ in range(5):
        last = train.train_step(ctx, model, opt, x.cuda(), y.cuda()).item()
    assert last < first
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_train_on_the_gpu_from_the_command_line(tmp_path):
    """`jobrun train --device cuda` in one process (it once failed in torch.cuda.set_device
    on the plain `cuda`), checkpointing tensors that lived on the GPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    plan = Path(__file__).resolve().parent.parent / "plans" / "mlp.yaml"
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "jobrun", "train", str(plan), "--device", "cuda",
                           "--run-dir", str(run), "max_epochs=2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and "cuda" in json.dumps(info)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_bound_step_takes_its_plain_lines_on_the_gpu(device, monkeypatch):
    """`device: cuda` in one process is the current GPU: the bound step (jobrun/ops/bound.py)
    must not hand every step to train_step because `cuda` != `cuda:0`."""
    from jobrun.ops import bound

    def general(*args, **kwargs):
        raise AssertionError("the bound step fell back to train_step")

    monkeypatch.setattr(train, "train_step", general)
    step = bound.bind_step(OpContext(device=device))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    loss = step(model, opt, x[:16].cuda(), y[:16].cuda())
    assert loss.is_cuda and loss.dtype == torch.float32
