"""Restoring a checkpoint into the objects init built checks every tensor's shape and
dtype (and a module's keys) first: a message naming the epoch, the blob, the key and
both shapes, and the live model left as init built it; a resume whose override changes
a shape says the run must start anew."""

from __future__ import annotations

import copy
import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from jobrun_test_helpers import mlp_plan
from runner_util import jobrun

from jobrun.errors import CheckpointError
from jobrun.runner import restore
from jobrun.store import SavedState

PLAN = mlp_plan("shapes", "seed: 0\nvars: {hidden: 8}\nmax_epochs: 1\ncheckpoint: {dir: ckpt}", batch=32,
                hidden='"${hidden}"')


def _node(**blobs):
    return SimpleNamespace(name="local", globals=dict(blobs), ctx=SimpleNamespace(device="cpu"))


def _saved(model, change):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    change(state)
    return SavedState("torch.nn.modules.linear.Linear", state, None)


@pytest.mark.parametrize(("change", "words"), [
    (lambda s: s.__setitem__("weight", s["weight"].t().contiguous()),
     "key 'weight': the checkpoint holds a tensor of shape [3, 2], the Linear init built has [2, 3]"),
    (lambda s: s.__setitem__("bias", torch.zeros(5)),
     "key 'bias': the checkpoint holds a tensor of shape [5], the Linear init built has [2]"),
    (lambda s: s.__setitem__("weight", s["weight"].double()),
     "key 'weight': the checkpoint holds a tensor of float64, the Linear init built has float32"),
    (lambda s: s.pop("bias"), "the checkpoint has no 'bias'"),
    (lambda s: s.__setitem__("extra", torch.zeros(1)), "the model has no 'extra'"),
])
def test_a_state_that_does_not_fit_the_model_is_refused_before_anything_is_loaded(change, words):
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saved = _saved(torch.nn.Linear(3, 2), change)
    with pytest.raises(CheckpointError) as caught:
        restore.into(_node(net=model), {"net": saved, "jobrun:rng": None}, 4)
    assert "checkpoint epoch 4, blob 'net' on node 'local'" in caught.value.message
    assert words in caught.value.message
    assert "jobrun train PLAN --run-dir NEW" in caught.value.hint
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_optimizer_state_of_other_shapes_is_refused():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["exp_avg"] = torch.zeros(7)
    with pytest.raises(CheckpointError, match="key 'state.0.exp_avg': the checkpoint holds a tensor of shape \\[7\\]"):
        restore._check_fits(_node(), "opt", opt, SavedState("torch.optim.adam.Adam", state, None), 1)
    fresh = torch.optim.Adam(model.parameters())  # no state yet: compared with the parameters
    with pytest.raises(CheckpointError, match="key 'state.0.exp_avg'.*shape \\[7\\].*\\[2, 3\\]"):
        restore._check_fits(_node(), "opt", fresh, SavedState("torch.optim.adam.Adam", state, None), 1)
    state["param_groups"][0]["params"] = [0]
    with pytest.raises(CheckpointError, match="holds 1 parameters, the one init built 2"):
        restore._check_fits(_node(), "opt", fresh, SavedState("torch.optim.adam.Adam", state, None), 1)


def test_resume_with_an_override_that_changes_a_shape_says_to_start_anew(tmp_path):
    (tmp_path / "plan.yaml").write_text(PLAN)
    run = tmp_path / "run"
    assert jobrun("train", tmp_path / "plan.yaml", "--run-dir", run).code == 0
    files = ["run.json", "plan.yaml", "metrics.jsonl"]

    def kept() -> dict:
        return {p: p.read_bytes() for p in [*sorted((run / "ckpt").rglob("*")), *(run / f for f in files)]
                if p.is_file()}

    before = kept()
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "max_epochs=2", "vars.hidden=16")
    assert r.code == 1, r.text
    assert ("checkpoint epoch 1, blob 'model' on node 'local', key '0.weight': the checkpoint holds a "
            "tensor of shape [8, 4], the Sequential init built has [16, 4]") in r.err
    assert "`jobrun train PLAN --run-dir NEW`" in r.err and "Traceback" not in r.text
    # Nothing was restored, so nothing of the run changed: not its checkpoints, and not
    # run.json, plan.yaml or metrics.jsonl (the failed overrides were once stored as the
    # run's, and every later plain resume failed with them).
    assert kept() == before
    r = jobrun("resume", "--run-dir", run, "max_epochs=2")
    assert r.code == 0, r.text
    info = json.loads((run / "run.json").read_text())
    assert (info["status"], info["last_epoch"], info["sets"]) == ("finished", 2, ["max_epochs=2"])


def test_a_checkpoint_from_another_plan_is_refused_naming_both_shapes(tmp_path):
    (tmp_path / "a.yaml").write_text(PLAN)
    (tmp_path / "b.yaml").write_text(PLAN.replace("hidden: 8", "hidden: 5"))
    for name in ("a", "b"):
        assert jobrun("train", tmp_path / f"{name}.yaml", "--run-dir", tmp_path / name).code == 0
    shutil.rmtree(tmp_path / "a" / "ckpt")
    shutil.copytree(tmp_path / "b" / "ckpt", tmp_path / "a" / "ckpt")  # b's epochs in a's run
    r = jobrun("resume", "--run-dir", tmp_path / "a", "--epoch", "1", "max_epochs=2")
    assert r.code == 1, r.text
    assert "key '0.weight': the checkpoint holds a tensor of shape [5, 4], the Sequential init built has [8, 4]" in r.err


def test_a_lazy_module_takes_its_shapes_from_the_checkpoint():
    trained = torch.nn.LazyLinear(2)
    trained(torch.ones(1, 3))
    saved = SavedState("torch.nn.modules.linear.LazyLinear", dict(trained.state_dict()), None)
    fresh = torch.nn.LazyLinear(2)
    restore._check_fits(_node(), "net", fresh, saved, 1)  # no shape to compare yet: no error
    fresh.load_state_dict(saved.state)
    assert torch.equal(fresh.weight, trained.weight)


def test_resume_with_an_override_that_changes_a_readers_data_says_to_start_anew(tmp_path):
    """A window reader's records change with its window: the saved position no longer
    fits. The hint said only that the checkpoint was damaged, and to resume from an
    earlier epoch, which fails the same way."""
    (tmp_path / "plan.yaml").write_text("""
job: windows
vars: {block: 8}
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - fill: {out: toks, shape: [40], value: 3, dtype: int64}
      - reader: {in: toks, out: data, window: "${block}", batch_size: 2, shuffle: true}
epoch:
  - task: read
    do:
      - read: {in: data, out: [x, y, done]}
""")
    run = tmp_path / "run"
    assert jobrun("train", tmp_path / "plan.yaml", "--run-dir", run).code == 0
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "vars.block=4")
    assert r.code == 1 and "blob 'data' on node 'local': its saved state does not load" in r.err, r.text
    assert "changed what init builds, the run must start anew (`jobrun train PLAN --run-dir NEW`)" in r.err


def test_going_back_removes_the_later_checkpoints_once_restored_and_keeps_them_when_it_fails(tmp_path):
    """`resume --epoch 1` trains epochs 2.. again. The old run's later checkpoints stayed:
    a branch stopped short of them (max_epochs=2 here) left the old epoch 3 the newest,
    which a plain resume and export then went on from, and `keep` pruned the new ones
    first. They are removed once the checkpoint is restored; a resume that fails before
    (an override that changes a shape) keeps every one."""
    (tmp_path / "plan.yaml").write_text(PLAN)
    run = tmp_path / "run"
    assert jobrun("train", tmp_path / "plan.yaml", "--run-dir", run, "max_epochs=3").code == 0

    def epochs() -> list[str]:
        return sorted(p.name for p in (run / "ckpt").iterdir() if not p.name.startswith("."))

    assert epochs() == ["local.0", "local.1", "local.2", "local.3"]
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "vars.hidden=16")
    assert r.code == 1 and epochs() == ["local.0", "local.1", "local.2", "local.3"], r.text
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "max_epochs=2", "checkpoint.keep=1")
    assert r.code == 0, r.text
    assert "removed the checkpoints of epochs 2-3, which this resume trains again" in r.out
    assert epochs() == ["local.2"]
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0 and "already finished at epoch 2" in r.out, r.text
    r = jobrun("ckpt", "list", run, "--json")
    assert [e["epoch"] for e in json.loads(r.out)["checkpoints"]] == [2], r.text


def test_going_back_on_a_damaged_metrics_line_is_refused_before_a_checkpoint_goes(tmp_path):
    """The resume removed the later checkpoints, then stopped on the damaged line it
    met as it dropped the later epochs' metrics: epoch 2 was gone, run.json still said
    finished at 2, and a plain resume had "nothing to do"."""
    (tmp_path / "plan.yaml").write_text(PLAN)
    run = tmp_path / "run"
    assert jobrun("train", tmp_path / "plan.yaml", "--run-dir", run, "max_epochs=2").code == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if '"step": ' in line)
    lines[n] = re.sub(r'"step": \d+', '"step": 1' + "0" * 30, lines[n])
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = (run / "run.json").read_text()
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 2 and f"metrics.jsonl:{n + 1}: field step:" in r.err and "damaged" in r.err, r.text
    assert "removed" not in r.out
    assert sorted(p.name for p in (run / "ckpt").iterdir() if not p.name.startswith(".")) == \
        ["local.0", "local.1", "local.2"]
    assert (run / "run.json").read_text() == before
