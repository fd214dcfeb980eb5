"""`parallel: fsdp`: models sharded with FSDP2 over 2 gloo ranks train as ddp does, save
sharded checkpoints (each rank its part), resume exactly, go to another number of ranks,
and export or save the whole model."""

from __future__ import annotations

import shutil

import pytest
from runner_util import ckpt_values, jobrun, jobrun_proc, logged

from jobrun import store
from jobrun.store.shards import SavedShard

PLAN = """
job: fs
seed: 7
max_epochs: 3
parallel: fsdp
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 150, features: 10, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 20, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [10, 33, 17, 3]}
      - optimizer: {in: model, out: opt, target: torch.optim.Adam, lr: 0.01}
epoch:
  - task: train
    do:
      - loop: 6
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss, clip_grad_norm: 1.0}
      - log: {in: [loss]}
download:
  - task: gather
    workspace: global
    do:
      - model.gather: {in: model, out: full}
exit:
  - task: save
    do:
      - save: {in: [model], path: model.safetensors}
"""


def test_parallel_must_be_ddp_or_fsdp(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: zero3"))
    r = jobrun("analyze", plan)
    assert r.code == 2
    assert "p.yaml:5:11" in r.err and "parallel must be ddp or fsdp, not 'zero3'" in r.err
    r = jobrun("print", plan, "parallel=fsdp")
    assert r.code == 0 and "parallel: fsdp" in r.out


def test_fsdp_layers_is_a_list_of_classes(tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: fsdp\nfsdp_layers: 3"))
    r = jobrun("analyze", plan)
    assert r.code == 2 and "p.yaml:6:14" in r.err
    assert "fsdp_layers must be a list of module classes, not the number 3" in r.err
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: fsdp\nfsdp_layers: [torch.nn.Linear]"))
    r = jobrun("print", plan)
    assert r.code == 0 and "fsdp_layers: [torch.nn.Linear]" in r.out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    (root / "plan.yaml").write_text(PLAN)
    for name, sets in (("fsdp", []), ("ddp", ["parallel=ddp"])):
        r = jobrun_proc("train", root / "plan.yaml", "--run-dir", root / name, "--replicas", "2", *sets,
                        timeout=300)
        assert r.code == 0, r.text
    return root


def _model(run, epoch=3):
    return ckpt_values(run, epoch)["model"]["state"]


def _close(a, b, tol=1e-6):
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol * max(1.0, abs(a))


@pytest.mark.slow
def test_fsdp_trains_as_ddp(runs):
    # ckpt show makes the sharded model whole from both ranks' files.
    fs, dd = _model(runs / "fsdp"), _model(runs / "ddp")
    assert fs.keys() == dd.keys() == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    for key in fs:
        assert _close(fs[key], dd[key]), key
    lf = [r["loss"] for r in logged(runs / "fsdp")]
    ld = [r["loss"] for r in logged(runs / "ddp")]
    assert len(lf) == len(ld) == 3 and all(_close(a, b, 1e-5) for a, b in zip(lf, ld))


@pytest.mark.slow
def test_each_rank_saves_its_shards(runs):
    sizes = []
    for rank in (0, 1):
        blobs, _ = store.load(runs / "fsdp" / "ckpt", "local", 3, rank=rank)
        w = blobs["model"].state["0.weight"]
        assert isinstance(w, SavedShard) and w.shape == (33, 10) and w.mesh == 2
        sizes.append(w.local.shape[0])
        exp_avg = blobs["opt"].state["state"][0]["exp_avg"]  # the optimizer's state too
        assert isinstance(exp_avg, SavedShard) and exp_avg.local.shape == w.local.shape
    assert sizes == [17, 16]  # torch.chunk of 33 rows over 2 ranks


@pytest.mark.slow
def test_saved_and_exported_models_are_whole(runs, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "m.safetensors"
    r = jobrun("export", runs / "fsdp", "--epoch", "3", "--blob", "model", "-o", out)
    assert r.code == 0, r.text
    exported = load_file(out)
    saved = load_file(runs / "fsdp" / "model.safetensors")  # the exit task's save, on rank 0
    assert exported["0.weight"].shape == (33, 10)
    assert all((saved[f"model.{k}"] == v).all() for k, v in exported.items())


@pytest.mark.slow
def test_fsdp_resume_is_exact(runs, tmp_path):
    run = tmp_path / "fsdp"
    shutil.copytree(runs / "fsdp", run)
    r = jobrun_proc("resume", "--run-dir", run, "--epoch", "1", timeout=300)
    assert r.code == 0, r.text
    assert _model(run) == _model(runs / "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("to", ["1"])
def test_fsdp_resume_with_another_number_of_ranks(runs, tmp_path, to):
    run = tmp_path / "fsdp"
    shutil.copytree(runs / "fsdp", run)
    r = jobrun_proc("resume", "--run-dir", run, "--epoch", "1", "--replicas", to, timeout=300)
    assert r.code == 0, r.text
    assert "resuming with 1 replica from a checkpoint of 2" in r.err
    want = _model(runs / "fsdp")
    got = _model(run)
    for key in want:
        assert _close(got[key], want[key], 1e-5), key
    # And back to 2 ranks: the whole model of 1 rank is sharded again.
    r = jobrun_proc("resume", "--run-dir", run, "--epoch", "2", "--replicas", "2", timeout=300)
    assert r.code == 0, r.text
    again = _model(run)
    for key in want:
        assert _close(again[key], want[key], 1e-5), key


@pytest.mark.slow
def test_char_lm_trains_the_same_with_fsdp_and_ddp(tmp_path):
    # A transformer: its blocks (a ModuleList) are sharded one by one.
    from pathlib import Path

    plan = Path(__file__).parent.parent / "plans" / "charlm.yaml"
    losses = {}
    layers = "fsdp_layers=[torch.nn.TransformerEncoderLayer, torch.nn.Embedding]"
    for name, sets in (("ddp", ["parallel=ddp"]), ("fsdp", ["parallel=fsdp"]),
                       ("typed", ["parallel=fsdp", layers])):
        r = jobrun_proc("train", plan, "--run-dir", tmp_path / name, "--replicas", "2", "max_epochs=1",
                        "vars.layers=1", *sets, timeout=300)
        assert r.code == 0, r.text
        losses[name] = logged(tmp_path / name)[0]
    for name in ("fsdp", "typed"):
        for key in ("loss", "val_loss"):
            assert _close(losses[name][key], losses["ddp"][key], 1e-5), (name, key)


@pytest.mark.slow
def test_fsdp_layers_the_model_lacks_is_one_clear_error(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("parallel: fsdp", "parallel: fsdp\nfsdp_layers: [torch.nn.Conv2d]"))
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / "run", "--replicas", "2", timeout=300)
    assert r.code == 1
    assert "fsdp_layers: the model has no torch.nn.Conv2d" in r.err
    assert "its modules are: Linear, ReLU" in r.err and "Traceback" not in r.err


@pytest.mark.slow
def test_a_killed_fsdp_rank_restarts_and_ends_as_an_uninterrupted_run(runs, tmp_path):
    # Rank 1 is SIGKILLed at step 3 of epoch 2 (once); the elastic agent restarts both
    # ranks, which resume from epoch 1's sharded checkpoint.
    text = PLAN.replace("      - loop: 6\n        do:", "      - add: {in: [epoch_no, 1], out: epoch_no}\n"
                        "      - loop: 6\n        as: i\n        do:")
    text = text.replace("          - train.step:", '          - call: {fn: "jobrun_test_helpers:die_once", '
                        f'in: [epoch_no, i], path: "{tmp_path / "deaths"}", at: 2, at_step: 3}}\n'
                        "          - train.step:")
    text = text.replace("      - optimizer:", "      - const: {out: epoch_no, value: 0}\n      - optimizer:")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / "run", "--replicas", "2", "--max-restarts", "1",
                    timeout=300)
    assert r.code == 0, r.text
    assert (tmp_path / "deaths").read_text().count("\n") == 1
    assert "restart 1: rank 1 died" in r.out + r.err
    got, want = _model(tmp_path / "run"), _model(runs / "fsdp")
    assert got == want
