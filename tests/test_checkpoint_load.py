"""`checkpoint.load`: the best (last, or a named) epoch's weights loaded back in `exit`, as
Lightning's `trainer.test(ckpt_path="best")`, checked against the checkpoint read by hand.

The plan trains a small model and computes val_loss from the epoch number, (e - 2)^2:
1, 0, 1, 4, so the best epoch (2) is known and is not the last.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runner_util import jobrun, jobrun_proc
from safetensors.torch import load_file

from jobrun import store
from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_text

PLAN = """\
job: best
max_epochs: 4
checkpoint: {dir: ckpt, best: {monitor: val_loss, mode: min}}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 4, classes: 3}
      - data.synthetic: {out: [tx, ty], task: classification, n: 64, features: 4, classes: 3, sample_seed: 7}
      - reader: {in: [x, y], out: data, batch_size: 16, passes: 0}
      - reader: {in: [tx, ty], out: test, batch_size: 64}
      - model.mlp: {out: model, sizes: [4, 8, 3]}
      - optimizer: {in: model, out: opt, lr: 0.5}
      - const: {out: e, value: 0}
epoch:
  - task: train
    do:
      - loop: 4
        do:
          - read: {in: data, out: [xb, yb]}
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - add: {in: [e, 1], out: e}
      - sub: {in: [e, 2], out: d}
      - mul: {in: [d, d], out: val_loss}
    outputs: [val_loss, loss]
exit:
  - task: test
    do:
      - checkpoint.load: {in: model, epoch: best}
      - evaluate: {in: [model, test], out: [test_loss, test_acc]}
      - save: {in: [test_loss, test_acc], path: test.json}
      - save: {in: [model, tx, ty], path: tested.safetensors}
"""


def _plan(tmp_path: Path, text: str = PLAN) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


def _saved_model(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    blobs, _ = store.load(run / "ckpt", "local", epoch)
    return blobs["model"].state


def _by_hand(run: Path, epoch: int) -> tuple[float, float]:
    """Test loss and accuracy of checkpoint `epoch`'s weights, loaded and evaluated in a
    plain torch loop (one batch of the 64 test records, in eval mode)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model.load_state_dict(_saved_model(run, epoch))
    model.eval()
    data = load_file(run / "tested.safetensors")
    # Copies: a tensor read from a file may sit at another alignment, which changes
    # the last bit of a CPU matmul; the run's reader gathers its batch into new memory.
    x, y = data["tx"].clone(), data["ty"].clone()
    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
    return loss * 64 / 64, (logits.argmax(-1) == y).sum().item() / 64


def _tested(run: Path) -> dict[str, torch.Tensor]:
    data = load_file(run / "tested.safetensors")
    return {k.removeprefix("model."): v for k, v in data.items() if k.startswith("model.")}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_exit_evaluates_the_best_epochs_weights(tmp_path):
    run = tmp_path / "run"
    r = jobrun("train", _plan(tmp_path), "--run-dir", run)
    assert r.code == 0, r.text
    assert "loaded model from checkpoint epoch 2 (the best by val_loss)" in r.out
    assert _equal(_tested(run), _saved_model(run, 2))
    assert not _equal(_tested(run), _saved_model(run, 4))  # the last epoch trained on
    result = json.loads((run / "test.json").read_text())
    assert (result["test_loss"], result["test_acc"]) == _by_hand(run, 2)


@pytest.mark.parametrize("epoch, loaded", [("last", 4), ("3", 3), ("0", 0)])
def test_last_or_a_numbered_epoch(tmp_path, epoch, loaded):
    run = tmp_path / "run"
    r = jobrun("train", _plan(tmp_path, PLAN.replace("epoch: best", f"epoch: {epoch}")), "--run-dir", run)
    assert r.code == 0, r.text
    assert f"loaded model from checkpoint epoch {loaded}\n" in r.out
    assert _equal(_tested(run), _saved_model(run, loaded))
    result = json.loads((run / "test.json").read_text())
    assert (result["test_loss"], result["test_acc"]) == _by_hand(run, loaded)


def test_a_resumed_run_loads_the_best_epoch_the_first_process_saved(tmp_path):
    plan = _plan(tmp_path)
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert jobrun("train", plan, "--run-dir", whole).code == 0
    r = jobrun("train", plan, "max_epochs=3", "--run-dir", part)
    assert r.code == 0, r.text
    r = jobrun("resume", part, "max_epochs=4")
    assert r.code == 0, r.text
    assert "loaded model from checkpoint epoch 2 (the best by val_loss)" in r.out
    assert _equal(_tested(part), _tested(whole))
    assert (part / "test.json").read_text() == (whole / "test.json").read_text()


def test_a_pruned_epoch_is_refused_with_the_ones_there_are(tmp_path):
    text = PLAN.replace("epoch: best", "epoch: 1").replace("dir: ckpt,", "dir: ckpt, keep: 1,")
    r = jobrun("train", _plan(tmp_path, text), "--run-dir", tmp_path / "run")
    assert r.code != 0
    assert "plan.yaml:28:9" in r.err and "no complete checkpoint of epoch 1" in r.err
    assert "the complete ones are epochs 2, 4; `checkpoint.keep: 1` deletes the older ones" in r.err
    assert "Traceback" not in r.text


def test_a_blob_that_is_no_tensor_nor_state_is_refused_before_any_load(tmp_path):
    text = PLAN.replace("{in: model, epoch: best}", "{in: [model, e], epoch: best}")
    run = tmp_path / "run"
    r = jobrun("train", _plan(tmp_path, text), "--run-dir", run)
    assert r.code != 0
    assert "blob 'e': checkpoint.load loads objects with a state" in r.err
    assert f"`jobrun export {run} --epoch 2 --node local --blob e -o e.json`" in r.err
    assert not (run / "tested.safetensors").exists()


def test_replicas_each_load_the_best_epoch(tmp_path):
    run = tmp_path / "run"
    r = jobrun_proc("train", _plan(tmp_path), "--run-dir", run, "--replicas", "2")
    assert r.code == 0, r.text
    assert r.out.count("loaded model from checkpoint epoch 2 (the best by val_loss)") == 1
    for rank in (0, 1):
        blobs, _ = store.load(run / "ckpt", "local", 2, rank=rank)
        assert _equal(_tested(run), blobs["model"].state)


def test_a_rank_whose_own_files_fail_stops_every_replica(tmp_path):
    """Rank 1's checkpoint files failed their checksum in checkpoint.load: rank 1 stopped,
    rank 0 loaded, ran the rest of exit and recorded the run finished while the launcher
    exited 1. Every rank now stops with one message, and the run is recorded failed."""
    run = tmp_path / "run"
    spoil = f'      - call: {{fn: "jobrun_test_helpers:spoil_own_checkpoint", ckpt: {str(run / "ckpt")!r}, which: 2}}\n'
    text = PLAN.replace("      - checkpoint.load: {in: model, epoch: best}\n",
                        spoil + "      - checkpoint.load: {in: model, epoch: best}\n")
    r = jobrun_proc("train", _plan(tmp_path, text), "--run-dir", run, "--replicas", "2")
    assert r.code == 1, r.text
    assert r.err.count("checkpoint.load of epoch 2 failed on rank 1:") == 1, r.text
    assert "loaded model" not in r.out and "finished" not in r.out, r.text
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    assert not (run / "test.json").exists()


def test_fsdp_replicas_load_their_slices_of_the_best_epoch(tmp_path):
    text = PLAN.replace("job: best\n", "job: best\nparallel: fsdp\ndevice: cpu\n").replace(
        "exit:\n  - task: test\n    do:\n      - checkpoint.load: {in: model, epoch: best}\n",
        "download:\n  - task: load\n    workspace: global\n    do:\n"
        "      - checkpoint.load: {in: model, epoch: best}\n      - model.gather: {in: model, out: full}\n"
        "exit:\n  - task: test\n    do:\n").replace("in: [model, tx, ty], path: tested", "in: [full], path: tested")
    run = tmp_path / "run"
    r = jobrun_proc("train", _plan(tmp_path, text), "--run-dir", run, "--replicas", "2")
    assert r.code == 0, r.text
    assert "loaded model from checkpoint epoch 2 (the best by val_loss)" in r.out
    assert jobrun("export", run, "--epoch", "2", "--blob", "model", "-o", tmp_path / "best.safetensors").code == 0
    gathered = {k.removeprefix("full."): v for k, v in load_file(run / "tested.safetensors").items()}
    assert _equal(gathered, load_file(tmp_path / "best.safetensors"))


@pytest.mark.parametrize("change, message", [
    (("exit:\n  - task: test", "exit:\n  - task: test\n    do:\n      - checkpoint.load: {in: model}\n"
      "  - task: test2"), None),
    (("      - mul: {in: [d, d], out: val_loss}",
      "      - mul: {in: [d, d], out: val_loss}\n      - checkpoint.load: {in: model}"),
     "checkpoint.load in `epoch`: it loads this run's checkpoints after training"),
    (("checkpoint: {dir: ckpt, best: {monitor: val_loss, mode: min}}\n", ""),
     "checkpoint.load: this plan writes no checkpoints"),
    ((", best: {monitor: val_loss, mode: min}", ""),
     "checkpoint.load loads the best epoch, but the plan has no `checkpoint.best`"),
    (("{in: model, epoch: best}", "{in: [model, tx], epoch: best}"),
     "checkpoint.load: blob 'tx' is not in the checkpoints: no step after init changes it"),
    (("mode: min}}", "mode: min}, exclude: [opt]}"),
     "checkpoint.load: blob 'opt' is not in the checkpoints: `checkpoint.exclude` drops it"),
    (("{in: model, epoch: best}", "{in: model, epoch: 99}"),
     "checkpoint.load loads epoch 99, after the last (max_epochs: "),
    # a name no step writes: only the flow check's error (read before defined), not this one's
    (("{in: model, epoch: best}", "{in: modle, epoch: best}"), "'modle'"),
])
def test_analyze_refuses_a_load_that_cannot_work(change, message):
    text = PLAN.replace(*change)
    if "exclude" in text:
        text = text.replace("{in: model, epoch: best}", "{in: [model, opt], epoch: best}")
    errors = [d.message for d in analyze(compile_text(text, "plan.yaml")) if d.severity == "error"]
    assert len(errors) == (message is not None) and all(message in e for e in errors), errors
