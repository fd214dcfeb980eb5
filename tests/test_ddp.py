"""Data parallel through torch's DDP: any backward through a model is synchronised (a
GAN's `call` step too), and a steady-state epoch reads no tensor value to the host."""

from __future__ import annotations

import pytest
from runner_util import ckpt_values, close, jobrun, jobrun_proc, logged

PLAN = """
job: ddp
seed: 3
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:count_host_reads"}
      - data.synthetic: {out: [x, y], task: classification, n: 45, features: 6, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 8, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [6, 16, 3]}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
      - call: {fn: "jobrun_test_helpers:gan_data", out: [z, real], n: 32}
      - reader: {in: [z, real], out: pairs, batch_size: 8, shuffle: true, passes: 0}
      - model.mlp: {out: G, sizes: [2, 8, 4]}
      - model.mlp: {out: D, sizes: [4, 8, 1]}
      - optimizer: {in: G, out: opt_g, target: torch.optim.Adam, lr: 0.01}
      - optimizer: {in: D, out: opt_d, target: torch.optim.Adam, lr: 0.01}
epoch:
  - task: train
    do:
      - call: {fn: "jobrun_test_helpers:host_reads", out: between}  # the last epoch's log points
      # 6 steps over 45 records in batches of 8: the last batch (5) splits 3 + 2
      - loop: 6
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - call: {fn: "jobrun_test_helpers:host_reads", out: reads}
      - log: {in: [loss, reads, between]}
      # one task: tasks of a group run at the same time, and ranks must issue DDP's
      # collectives in one order
      - loop: 4
        do:
          - read: {in: pairs, out: [zb, rb, done]}
          - if: done
            then: [{read: {in: pairs, out: [zb, rb, done]}}]
          - call: {fn: "jobrun_test_helpers:gan_step", in: [G, D, opt_g, opt_d, zb, rb], out: [loss_d, loss_g]}
      - log: {in: [loss_d, loss_g]}
"""

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    (root / "plan.yaml").write_text(PLAN)
    for n in ("1", "2"):
        r = jobrun_proc("train", root / "plan.yaml", "--run-dir", root / f"r{n}", "--replicas", n)
        assert r.code == 0, r.text
    return root


@pytest.mark.slow
def test_a_gan_step_written_as_a_call_trains_the_same_models_on_two_replicas(runs):
    """Its backwards go through DDP's hooks: without them the replicas drift apart."""
    one, two = ckpt_values(runs / "r1", 2), ckpt_values(runs / "r2", 2)
    first = ckpt_values(runs / "r1", 0)
    for name in ("G", "D", "model"):
        w1, w2 = one[name]["state"], two[name]["state"]
        assert w1.keys() == w2.keys() == first[name]["state"].keys()  # the module's own keys
        for key in w1:
            assert close(w1[key], w2[key], 1e-5), (name, key)
            assert w1[key] != first[name]["state"][key], (name, key)  # it trained
    # train.step's loss is the global batch's on every rank (a `call`'s losses are the
    # user's, each rank's own)
    got1 = [r["loss"] for r in logged(runs / "r1") if "loss" in r]
    got2 = [r["loss"] for r in logged(runs / "r2") if "loss" in r]
    assert len(got1) == len(got2) == 2 and all(close(a, b, 1e-5) for a, b in zip(got1, got2))


@pytest.mark.slow
def test_training_steps_read_no_tensor_value_to_the_host(runs):
    """train.step leaves its loss on the device; the loop reads nothing (the uneven last
    batch's weights come from the reader's split, the stop flags through CPU memory)."""
    for run in ("r1", "r2"):
        rows = [r for r in logged(runs / run) if "reads" in r]
        assert [r["reads"] for r in rows] == [0, 0], run
        assert rows[1]["between"] > 0  # the counter counts: epoch 1's log and epoch line read


# -- devices ---------------------------------------------------------------------------


def test_one_gpu_for_every_replica_is_refused_before_anything_is_written(tmp_path):
    from runner_util import jobrun

    (tmp_path / "plan.yaml").write_text(PLAN)
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2",
               "--device", "cuda:1")
    assert r.code == 2, r.text
    assert "device 'cuda:1' names one GPU, but 2 replicas each need their own" in r.err
    assert "use device cuda" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cuda,mps,world,local,expect", [
    (True, True, 1, 0, "cuda"), (False, True, 1, 0, "mps"), (False, False, 1, 0, "cpu"),
    (True, False, 2, 1, "cuda:1"),  # auto with replicas: each rank of a host its own GPU
])
def test_devices_auto_picks_cuda_then_mps_then_cpu_and_ranks_get_their_own_gpu(
        monkeypatch, cuda, mps, world, local, expect):
    import torch

    from jobrun.runner.devices import device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_RANK", str(local))
    assert device_for("auto", world) == expect


def test_more_ranks_on_a_host_than_gpus_is_refused(monkeypatch):
    import torch

    from jobrun.errors import UsageError
    from jobrun.runner.devices import device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UsageError, match="rank 2 of this host has no GPU of its own: it has 2"):
        device_for("cuda", 3, select=False)


# -- torch.compile -------------------------------------------------------------------


COMPILED = """
job: compiled
seed: 1
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 32, features: 4, classes: 3}
      - reader: {in: [x, y], out: data, batch_size: 8, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [4, 8, 3], compile: COMPILE}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: 4
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - log: {in: [loss]}
"""


def test_a_compiled_model_trains_as_the_plain_one_and_is_saved_once(tmp_path):
    from runner_util import jobrun

    runs = {}
    for flag in ("true", "false"):
        plan = tmp_path / f"{flag}.yaml"
        plan.write_text(COMPILED.replace("COMPILE", flag))
        r = jobrun("train", plan, "--run-dir", tmp_path / flag)
        assert r.code == 0, r.text
        runs[flag] = ckpt_values(tmp_path / flag, 2)["model"]["state"]
    assert runs["true"].keys() == runs["false"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for key in runs["true"]:
        assert close(runs["true"][key], runs["false"][key], 1e-5), key


# -- batches on their way to the device ---------------------------------------------------


def test_every_reader_tags_a_ranks_part_with_the_records_of_the_global_batch():
    """What train.step weights a rank's loss with, without a collective to count them."""
    import torch
    from torch.utils.data import TensorDataset

    from jobrun.ops.context import OpContext
    from jobrun.ops.reader import read_op, reader_op
    from jobrun.ops.split import global_records

    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    for rank in (0, 1):
        ctx = OpContext(rank=rank, world_size=2)
        for source in ((x, y), (TensorDataset(x, y),)):
            r = reader_op(ctx, *source, batch_size=3)  # batches of 3 and 2 records
            (_, yb, _), (xb2, yb2, _) = read_op(ctx, r), read_op(ctx, r)
            assert [len(yb), len(yb2)] == ([2, 1] if rank == 0 else [1, 1])
            assert [global_records(yb), global_records(xb2)] == [3, 2]
    assert global_records(y) is None  # a tensor no reader split: train.step counts it


def test_batches_move_to_the_device_by_one_function_keeping_their_structure():
    import torch

    from jobrun.ops.transfer import ToDevice

    t = torch.arange(4.0)
    moved = ToDevice("cpu")((t, {"ids": t.long()}, [t, "name"], 3))
    assert torch.equal(moved[0], t) and moved[1]["ids"].dtype == torch.long
    assert moved[2][1] == "name" and moved[3] == 3 and isinstance(moved[2], list)


UNUSED = """
job: unused
max_epochs: 1
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 32, features: 4, classes: 2}
      - reader: {in: [x, y], out: data, batch_size: 8}
      - build: {out: model, target: "jobrun_test_helpers:WithUnusedHead"}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: 3
        do:
          - read: {in: data, out: [xb, yb, end]}
          - train.step: {in: [model, opt, xb, yb], out: loss}
"""


@pytest.mark.slow
def test_a_parameter_without_a_gradient_under_ddp_is_one_clear_error(tmp_path):
    (tmp_path / "plan.yaml").write_text(UNUSED)
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2")
    assert r.code == 1, r.text
    assert "parameters of the model got no gradient" in r.err and "Traceback" not in r.err
    one = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "one")  # in this process
    assert one.code == 0, one.text  # one process: the unused head keeps grad None, as in torch


EMA = """
job: ema
seed: 3
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 32, features: 6, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 8, passes: 0}
      - model.mlp: {out: model, sizes: [6, 16, 3]}
      - build:
          in: [model]
          out: ema
          target: torch.optim.swa_utils.AveragedModel
          multi_avg_fn: {target: torch.optim.swa_utils.get_ema_multi_avg_fn, args: [0.9]}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: 4
        do:
          - read: {in: data, out: [xb, yb]}
          - train.step: {in: [model, opt, xb, yb], out: loss}
          - call: {fn: "jobrun_test_helpers:ema_update", in: [ema, model], mutates: [ema]}
          - call: {fn: "jobrun_test_helpers:frozen_teacher", in: [model, xb], out: teacher_sum, pure: true}
"""


def test_an_ema_of_a_replicated_model_is_built_as_with_one_process(tmp_path):
    """`AveragedModel(model)` deep-copies the model: torch refuses to copy a module DDP
    holds ("DDP does not support deepcopy"), so the standard EMA recipe failed in init
    with replicas. The copy is the model as built, without DDP: the same EMA as 1 replica.
    A copy frozen and run with gradients on (a distillation's teacher) is no replicated
    model: it was refused as one whose trained parameters changed."""
    (tmp_path / "plan.yaml").write_text(EMA)
    for n in ("1", "2"):
        r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / f"r{n}", "--replicas", n)
        assert r.code == 0 and "Traceback" not in r.err, r.text
    one, two = (ckpt_values(tmp_path / f"r{n}", 2) for n in ("1", "2"))
    ema, model = one["ema"]["state"], one["model"]["state"]
    assert ema.keys() == two["ema"]["state"].keys() >= {"module.0.weight", "n_averaged"}
    assert all(close(ema[k], two["ema"]["state"][k], 1e-5) for k in ema)
    assert ema["module.0.weight"] != model["0.weight"]  # an average of the steps, not the model


NO_EMPTY = '''
import torch

class NoEmpty(torch.nn.Module):
    """Cannot run a batch of no records, as a Hugging Face model's reshape."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x.view(x.shape[0], -1, 6).mean(1))
'''

SHORT_LAST = """
job: short
seed: 3
max_epochs: 1
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: N, features: 6, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 5}
      - build: {out: model, target: "noempty:NoEmpty"}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: data, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss, accumulate: 2}
"""


def test_a_rank_with_fewer_records_than_micro_batches_syncs_in_its_last_one_with_records(tmp_path):
    """12 records in batches of 5: the last (2) gives each of 2 ranks 1 record, so its
    second micro-batch is empty. DDP's sync ran a forward of that empty batch, which a
    Hugging Face model cannot run: the job died at the end of the first pass."""
    (tmp_path / "noempty.py").write_text(NO_EMPTY)
    (tmp_path / "plan.yaml").write_text(SHORT_LAST.replace("n: N", "n: 12"))
    for n in ("1", "2"):
        r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / f"r{n}", "--replicas", n)
        assert r.code == 0, r.text
    one, two = (ckpt_values(tmp_path / f"r{n}", 1)["model"]["state"] for n in ("1", "2"))
    assert all(close(one[k], two[k], 1e-5) for k in one)


def test_a_rank_with_no_records_and_a_model_that_cannot_run_none_is_told_what_to_do(tmp_path):
    """11 records in batches of 5: the last (1) leaves rank 1 nothing, and its forward for
    DDP's collectives meets the model's reshape: one message naming why, and drop_last."""
    (tmp_path / "noempty.py").write_text(NO_EMPTY)
    (tmp_path / "plan.yaml").write_text(SHORT_LAST.replace("n: N", "n: 11"))
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2")
    assert r.code == 1 and "replica rank 1 has no records of this global batch" in r.err, r.text
    assert "`drop_last: true`" in r.err and "Traceback" not in r.err


FREEZE = """
job: freeze
seed: 3
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 32, features: 6, classes: 3}
      - reader: {in: [x, y], out: data, batch_size: 8, passes: 0}
      - build: {out: model, target: "freeze:net", frozen: FROZEN}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - call: {fn: "freeze:first_layer", in: [model], mutates: [model]}
      - loop: 2
        do:
          - read: {in: data, out: [xb, yb]}
          - train.step: {in: [model, opt, xb, yb], out: loss}
"""
FREEZE_PY = """
import torch

def net(frozen):
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model[0].requires_grad_(not frozen)
    return model

def first_layer(model, *, epoch):  # a fine-tune's backbone: frozen in epoch 1, then trained
    model[0].requires_grad_(epoch > 1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True])
def test_freezing_parameters_after_ddp_wrapped_the_model_is_one_clear_error(tmp_path, frozen):
    """DDP all-reduces the parameters that required grad when it was made. Frozen later
    (a fine-tune's epoch 1), they got "no gradient in this step" with a hint to set
    requires_grad=False, which the plan had done; unfrozen later (built frozen, trained
    from epoch 2), each rank trained them on its own slice's gradient and the ranks' weights
    drifted apart (8e-3 from one process in 3 epochs) without a word."""
    (tmp_path / "plan.yaml").write_text(FREEZE.replace("FROZEN", str(frozen).lower()))
    (tmp_path / "freeze.py").write_text(FREEZE_PY)
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2")
    assert r.code == 1, r.text
    which = "unfrozen 0.weight, 0.bias" if frozen else "frozen 0.weight, 0.bias"
    assert f"trained parameters changed after it was built ({which})" in r.err, r.err
    assert "requires_grad in the model's constructor" in r.err and "Traceback" not in r.err
    assert "replica rank" not in r.err and r.err.count("changed after it was built") == 1  # the job's
    one = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "one")
    assert one.code == 0, one.text  # one process: no DDP, freezing works as in torch
