"""Checkpoints without init's products: resume rebuilds them with init, checks them by
fingerprint, and restores what state_dict leaves out (modes, frozen parameters)."""

from __future__ import annotations

import pytest
import torch
from runner_util import ckpt_values, data_plan, jobrun, logged, write_data

from jobrun import store
from jobrun.store.codec import decode, encode, restore

DATA_PLAN = data_plan()


def _saved(run, epoch: int, blob: str):
    """A blob as the checkpoint holds it (`ckpt show` leaves out the random state and a
    module's flags)."""
    blobs, _ = store.load(run / "ckpt", "local", epoch, blobs=[blob])
    return blobs[blob]


def _rng(run, epoch: int) -> dict:
    return _saved(run, epoch, "jobrun:rng")


@pytest.fixture
def data_run(tmp_path):
    write_data(tmp_path / "data.npz")
    (tmp_path / "plan.yaml").write_text(DATA_PLAN)
    run = tmp_path / "run"
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", run, "--set", "max_epochs=2")
    assert r.code == 0, r.text
    return tmp_path, run


def test_a_checkpoint_holds_no_data_and_records_its_fingerprint(data_run):
    _, run = data_run
    assert set(ckpt_values(run, 2)) == {"r", "model", "opt"}
    # the random streams are where init left them: listed, not saved
    saved = _rng(run, 2)
    assert saved.pop("unchanged") == ["python", "numpy", "torch", "node"]
    # the node's counters: readers made, and the global step (optimizer steps taken)
    assert saved == {"ctx_state": {"reader.ordinal": 1, "step": 8}}
    _, meta = store.load(run / "ckpt", "local", 2)
    assert meta["init"]["x"] == {"tensor": [16, 3], "dtype": "float32", "crc": meta["init"]["x"]["crc"]}
    r = jobrun("resume", "--run-dir", run, "max_epochs=3")
    assert r.code == 0, r.text


def test_changed_data_stops_a_resume_naming_the_blob_and_force_goes_on(data_run):
    root, run = data_run
    write_data(root / "data.npz", scale=2.0)
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 1
    assert "cannot resume from checkpoint epoch 1: init built other things than when the run started" in r.err
    assert "blob 'x': float32 [16, 3] with CRC-32" in r.err and "blob 'y'" not in r.err
    assert f"`jobrun resume {run} --epoch 1 --force`" in r.err  # not the latest run: named
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "--force")
    assert r.code == 0, r.text
    assert "resuming anyway (--force, or overrides that change the plan)" in r.err
    assert [v["_epoch"] for v in logged(run)] == [1, 2]


FREEZE_PLAN = """
job: freeze
max_epochs: 5
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 4, classes: 3}
      - reader: {in: [x, y], out: r, batch_size: 16, passes: 0}
      - model.mlp: {out: model, sizes: [4, 8, 8, 3], dropout: 0.2}
      - optimizer: {in: model, out: opt, lr: 0.1}
      - call: {fn: "freezing:freeze", in: [model]}     # the first layer starts frozen
      - const: {out: epoch, value: 0}
epoch:
  - task: train
    do:
      - add: {in: [epoch, 1], out: epoch}
      - eq: {in: [epoch, 3], out: thaw}
      - if: thaw
        then: [{call: {fn: "freezing:unfreeze", in: [model]}}]
      - loop: null
        do:
          - read: {in: r, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - log: {in: [loss]}
"""

FREEZING = '''
def freeze(model):
    for p in model[0].parameters():
        p.requires_grad_(False)
    model[2].eval()  # the first dropout off: a mode state_dict does not hold


def unfreeze(model):
    for p in model[0].parameters():
        p.requires_grad_(True)
'''


def test_a_layer_unfrozen_after_init_stays_unfrozen_on_resume(tmp_path):
    (tmp_path / "plan.yaml").write_text(FREEZE_PLAN)
    (tmp_path / "freezing.py").write_text(FREEZING)
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert jobrun("train", tmp_path / "plan.yaml", "--run-dir", reference).code == 0
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", run, "--set", "max_epochs=3")
    assert r.code == 0, r.text
    flags = _saved(run, 2, "model").module
    assert flags == {"training": True, "flipped": ["2"], "frozen": ["0.weight", "0.bias"]}
    assert _saved(run, 3, "model").module["frozen"] == []
    # dropout draws from torch's stream after init: it is saved
    assert "torch" in _rng(run, 3) and "torch" not in _rng(run, 3)["unchanged"]
    r = jobrun("resume", "--run-dir", run, "max_epochs=5")  # init freezes the layer again
    assert r.code == 0, r.text
    assert ckpt_values(run, 5) == ckpt_values(reference, 5)
    assert logged(run) == logged(reference)


def test_module_modes_and_frozen_parameters_round_trip_through_the_codec():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(), torch.nn.Linear(2, 1))
    model[1].eval()
    model[2].weight.requires_grad_(False)
    tree, tensors = encode({"m": model})
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(), torch.nn.Linear(2, 1))
    restore(fresh, decode(tree, tensors)["m"])
    assert [m.training for m in fresh.modules()] == [True, True, False, True]
    assert [p.requires_grad for p in fresh.parameters()] == [True, True, False, True]
    assert torch.equal(fresh[0].weight, model[0].weight)
