"""Mixed precision (`train.step` amp): autocast on the run's device, CPU included, and the
fp16 loss scaler's state in the optimizer's checkpoint, so that resume stays exact."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from runner_util import HANG_S, jobrun, logged

from jobrun import store
from jobrun.ops import train
from jobrun.store.shards import SavedShard

CPU = SimpleNamespace(device="cpu", world_size=1, distributed=False)


def _model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.randn(32, 8), torch.randint(0, 3, (32,))


@pytest.mark.parametrize("amp, dtype", [(None, torch.float32), ("bf16", torch.bfloat16),
                                        ("fp16", torch.float16)])
def test_amp_autocasts_the_forward_on_cpu(amp, dtype, monkeypatch):
    seen = []

    def loss(pred, y):
        seen.append(pred.dtype)
        return torch.nn.functional.cross_entropy(pred, y)

    monkeypatch.setitem(train._LOSSES, "recording", loss)
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train.train_step(CPU, model, opt, x, y, loss="recording", amp=amp)
    assert seen == [dtype]
    # The parameters stay float32: autocast changes what the forward computes in.
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("amp, dtype", [(None, torch.float32), ("bf16", torch.bfloat16)])
def test_evaluate_autocasts_with_its_amp(amp, dtype, monkeypatch):
    from jobrun.ops.context import OpContext
    from jobrun.ops.reader import reader_op

    seen = []

    def loss(pred, y):
        seen.append(pred.dtype)
        return torch.nn.functional.cross_entropy(pred.float(), y)

    monkeypatch.setitem(train._LOSSES, "recording", loss)
    train._loss_fn.cache_clear()  # evaluate looks losses up through a cache
    model, x, y = _model_and_data()
    ctx = OpContext()
    got = train.evaluate(ctx, model, reader_op(ctx, x, y, batch_size=16), loss="recording", amp=amp)
    assert seen == [dtype, dtype]
    plain = train.evaluate(ctx, model, reader_op(ctx, x, y, batch_size=16))
    # bf16 rounds the logits: close to the float32 loss, and not equal to it.
    assert got[0] == pytest.approx(plain[0], rel=2e-2)
    assert (got[0] == plain[0]) == (amp is None)
    with pytest.raises(Exception, match="evaluate: unknown amp 'fp8'"):
        train.evaluate(ctx, model, reader_op(ctx, x, y, batch_size=16), amp="fp8")


def test_fp16_scaler_state_lives_in_the_optimizer_state_dict():
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        train.train_step(CPU, model, opt, x, y, amp="fp16")
    scaler = opt._jobrun_scaler
    saved = opt.state_dict()["param_groups"][0][train.SCALER_KEY]
    assert saved == scaler.state_dict()
    assert saved["_growth_tracker"] + (saved["scale"] < 65536.0) > 0  # it moved

    # A new optimizer loading that state makes its scaler from it on the first fp16 step.
    model2, _, _ = _model_and_data()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    opt2.load_state_dict(opt.state_dict())
    train.train_step(CPU, model2, opt2, x, y, amp="fp16")
    # One step later: the saved scale, or it halved (an overflow) or doubled (growth).
    assert opt2._jobrun_scaler.get_scale() in (saved["scale"], saved["scale"] * 2, saved["scale"] / 2)
    assert opt2._jobrun_scaler._growth_tracker.item() in (0, saved["_growth_tracker"] + 1)


def test_unknown_amp_is_one_clear_error():
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Exception, match="unknown amp 'fp8'"):
        train.train_step(CPU, model, opt, x, y, amp="fp8")


# Inputs large enough that the first fp16 steps overflow at the initial scale (2^16): the
# scaler backs off and skips those steps, so its state after an epoch is not the initial
# one, and a resume that lost it would skip steps the uninterrupted run took.
PLAN = """
job: amp
seed: 1
max_epochs: 4
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 192, features: 8, classes: 3, noise: 1.0}
      - mul: {in: [x, 40.0], out: x}
      - reader: {in: [x, y], out: data, batch_size: 32, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [8, 64, 3]}
      - optimizer: {in: model, out: opt, lr: 0.01, momentum: 0.9}
epoch:
  - task: train
    do:
      - loop: 6
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss, amp: AMP}
      - log: {in: [loss]}
"""


def _run(tmp_path, amp: str):
    plan = tmp_path / f"{amp}.yaml"
    plan.write_text(PLAN.replace("AMP", amp))
    run = tmp_path / f"run-{amp}"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    return run


def _state(run, epoch: int, rank: int = 0) -> dict:
    blobs, _ = store.load(run / "ckpt", "local", epoch, rank=rank)
    return {"model": blobs["model"].state, "opt": blobs["opt"].state}


def _same(a, b) -> bool:
    if isinstance(a, SavedShard):  # parallel: fsdp: a rank's part of a tensor
        return isinstance(b, SavedShard) and _same(a.local, b.local) and \
            (a.shape, a.stride, a.placements, a.mesh) == (b.shape, b.stride, b.placements, b.mesh)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_amp_job_resumes_bit_exact(tmp_path, amp):
    ref = _run(tmp_path, amp)
    want = _state(ref, 4)
    if amp == "fp16":
        scaler = [_state(ref, e)["opt"]["param_groups"][0][train.SCALER_KEY] for e in (1, 2)]
        assert scaler[0]["scale"] < 65536.0, "the plan should make the first steps overflow"
        assert scaler[0] != scaler[1]
    for epoch in (1, 2):
        run = tmp_path / f"from{epoch}-{amp}"
        shutil.copytree(ref, run)
        r = jobrun("resume", "--run-dir", run, "--epoch", str(epoch))
        assert r.code == 0, r.text
        assert _same(_state(run, 4), want), f"{amp}: resume from epoch {epoch} diverged"


def test_bf16_trains_differently_from_fp32(tmp_path):
    plain = PLAN.replace("      - mul: {in: [x, 40.0], out: x}\n", "")
    losses = {}
    for name, text in (("fp32", plain.replace(", amp: AMP", "")), ("bf16", plain.replace("AMP", "bf16"))):
        (tmp_path / f"{name}.yaml").write_text(text)
        r = jobrun("train", tmp_path / f"{name}.yaml", "--run-dir", tmp_path / name)
        assert r.code == 0, r.text
        losses[name] = [v["loss"] for v in logged(tmp_path / name)]
    lo, lb = losses["fp32"], losses["bf16"]
    assert lb[-1] < lb[0]  # it learns
    assert lo != lb  # in other arithmetic
    assert lb == pytest.approx(lo, rel=0.1)  # close to the float32 run


BF16 = PLAN.replace("      - mul: {in: [x, 40.0], out: x}\n", "").replace("AMP", "bf16")


@pytest.fixture(scope="module")
def bf16_ddp(tmp_path_factory):
    """BF16's job on 2 replicas (ddp), which the two tests below compare with."""
    from runner_util import jobrun_proc

    root = tmp_path_factory.mktemp("bf16")
    (root / "plan.yaml").write_text(BF16)
    r = jobrun_proc("train", root / "plan.yaml", "--run-dir", root / "ddp", "--replicas", "2", timeout=HANG_S)
    assert r.code == 0, r.text
    return root / "ddp"


@pytest.mark.slow
def test_bf16_with_two_replicas_trains_as_one(tmp_path, bf16_ddp):
    plan = tmp_path / "plan.yaml"
    plan.write_text(BF16)
    r = jobrun("train", plan, "--run-dir", tmp_path / "r1")  # one replica: in this process
    assert r.code == 0, r.text
    losses = [[v["loss"] for v in logged(run)] for run in (tmp_path / "r1", bf16_ddp)]
    # Each rank autocasts its half of the batch: bf16 rounding differs, the run does not.
    assert len(losses[0]) == len(losses[1]) == 4
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_fsdp_with_amp_trains_as_ddp_and_resumes_bit_exact(request, tmp_path, amp):
    # parallel: fsdp gathers the parameters in the amp's dtype (FSDP's MixedPrecisionPolicy)
    from runner_util import jobrun_proc

    plan = tmp_path / "plan.yaml"
    plan.write_text(BF16 if amp == "bf16" else PLAN.replace("AMP", amp))
    # ddp is the plan's default: bf16's ddp run is the module's (the same job)
    for parallel in ("fsdp",) if amp == "bf16" else ("fsdp", "ddp"):
        r = jobrun_proc("train", plan, "--run-dir", tmp_path / parallel, "--replicas", "2",
                        f"parallel={parallel}", timeout=HANG_S)
        assert r.code == 0, r.text
    fs, dd = tmp_path / "fsdp", request.getfixturevalue("bf16_ddp") if amp == "bf16" else tmp_path / "ddp"
    if amp == "fp16":
        # Every rank's loss scaler follows ddp's: the same steps overflow and are skipped.
        for epoch in (1, 2, 3, 4):
            want = _state(dd, epoch)["opt"]["param_groups"][0][train.SCALER_KEY]
            for rank in (0, 1):
                assert _state(fs, epoch, rank)["opt"]["param_groups"][0][train.SCALER_KEY] == want
        assert want["scale"] < 65536.0  # it did back off
    lf, ld = ([v["loss"] for v in logged(run)] for run in (fs, dd))
    assert len(lf) == len(ld) == 4
    assert lf[0] == pytest.approx(ld[0], rel=1e-2)  # the same steps in other rounding
    if amp == "bf16":
        assert lf == pytest.approx(ld, rel=2e-2)
    # The shards (and the optimizer) stay float32; a resume picks up exactly.
    assert _state(fs, 4)["model"]["0.weight"].local.dtype == torch.float32
    run = tmp_path / "resumed"
    shutil.copytree(fs, run)
    r = jobrun_proc("resume", "--run-dir", run, "--epoch", "2", timeout=HANG_S)
    assert r.code == 0, r.text
    for rank in (0, 1):
        assert _same(_state(run, 4, rank), _state(fs, 4, rank)), f"rank {rank} diverged"
