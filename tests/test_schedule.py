"""`scheduler` without a target: warmup and decay in closed form from the global step."""

from __future__ import annotations

import math

import pytest
from runner_util import ckpt_values, jobrun, logged

PLAN = """\
job: sched
max_steps: {max_steps}
checkpoint: {{dir: ckpt}}
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: regression, n: 16, features: 3}}
      - model.mlp: {{out: model, sizes: [3, 4, 1]}}
      - optimizer: {{in: model, out: opt, target: torch.optim.AdamW, lr: 0.001}}
      - scheduler: {{in: opt, out: sched, {schedule}}}
epoch:
  - task: train
    do:
      - loop: 10
        do:
          - train.step: {{in: [model, opt, x, y], out: loss, loss: mse}}
          - call: {{fn: "jobrun_test_helpers:last_lr", in: sched, out: lr, mutates: []}}
          - log: {{in: [lr]}}
"""


def get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT's train.py, as written there."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def train(tmp_path, schedule: str, max_steps: int = 30):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(schedule=schedule, max_steps=max_steps))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    return run


def test_warmup_then_cosine_is_nanogpts_get_lr_bit_for_bit(tmp_path):
    run = train(tmp_path, "warmup: 5, decay: cosine, steps: 25, min_lr: 0.0001")
    lrs = [v["lr"] for v in logged(run)]
    assert len(lrs) == 30
    assert lrs == [get_lr(k, 0.001, 5, 25, 0.0001) for k in range(30)]  # exact, past the end too


@pytest.mark.parametrize("decay, expect", [
    ("linear", lambda k: 0.001 * (k + 1) / 3 if k < 2 else (
        0.0 + (1.0 - (min(k, 20) - 2) / 18) * 0.001 if k <= 20 else 0.0)),
    ("constant", lambda k: 0.001 * (k + 1) / 3 if k < 2 else 0.001),
])
def test_linear_and_constant_shapes(tmp_path, decay, expect):
    run = train(tmp_path, f"warmup: 2, decay: {decay}, steps: 20")
    assert [v["lr"] for v in logged(run)] == [expect(k) for k in range(30)]


def test_min_ratio_scales_each_groups_rate(tmp_path):
    run = train(tmp_path, "decay: cosine, steps: 10, min_ratio: 0.5")
    lrs = [v["lr"] for v in logged(run)]
    assert lrs[0] == 0.001 and lrs[-1] == 0.001 * 0.5


def test_resume_goes_on_at_the_rate_of_the_global_step(tmp_path):
    schedule = "warmup: 5, decay: cosine, steps: 25, min_ratio: 0.1"
    run = train(tmp_path, schedule)
    whole = ckpt_values(run, 3)
    lrs = [v["lr"] for v in logged(run)]
    assert jobrun("resume", "--run-dir", run, "--epoch", "1").code == 0
    assert [v["lr"] for v in logged(run)] == lrs
    assert ckpt_values(run, 3) == whole  # the model and the optimizer, bit for bit


@pytest.mark.parametrize("schedule, message", [
    ("warmup: 5, decay: cosine, steps: 5", "steps (where the cosine decay ends) must be a whole number above warmup (5)"),
    ("target: torch.optim.lr_scheduler.StepLR, step_size: 2, warmup: 3", "warmup belong(s) to the schedule without a target"),
    ("steps: 10, step_size: 2", "step_size need(s) a `target`"),
    ("steps: 10, min_lr: -1", "argument `min_lr` of `scheduler` is -1; expected a number >= 0"),  # by analyze
])
def test_bad_schedules_are_one_message(tmp_path, schedule, message):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(schedule=schedule, max_steps=3))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code != 0 and message in r.err and "plan.yaml:10:" in r.err and "Traceback" not in r.text


def test_a_decay_that_does_not_exist_is_caught_by_analyze(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(schedule="decay: cosin, steps: 10", max_steps=3))
    r = jobrun("analyze", plan)
    assert r.code == 1 and "cosine" in r.out + r.err


@pytest.mark.parametrize("schedule, message, hint", [
    ("warmpu: 10, steps: 100", "warmpu need(s) a `target`", "did you mean 'warmup'"),
    ("warmup: 60, steps: 40", "must be a whole number above warmup (60); got 40", "decay: constant"),
    ("warmup: 6", "must be a whole number above warmup (6); it is not given", "steps: 5000"),
])
def test_analyze_refuses_a_schedule_the_op_would_refuse_before_train_makes_a_run(tmp_path, schedule, message,
                                                                                  hint):
    """The op's own rule (jobrun.ops.schedule.problem), asked by analyze: these passed it
    and failed at run time, after init, leaving a failed run directory."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(schedule=schedule, max_steps=3))
    r = jobrun("analyze", plan)
    assert r.code == 1 and "plan.yaml:10:" in r.out and message in r.out and hint in r.out, r.text
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and message in r.err and not (tmp_path / "run").exists()
    ok = jobrun("analyze", plan, "--set", "init.setup.scheduler.decay=constant") if "warmpu" not in schedule else r
    assert "warmpu" in schedule or ok.code == 0, ok.text


@pytest.mark.parametrize("given", ["warmup: 0", "warmup: 3"])
def test_analyze_refuses_the_schedules_keys_beside_a_target_before_train_makes_a_run(tmp_path, given):
    """`warmup: 0` beside a target passed the op unseen (it is the op's default), so a
    scheduler class of one's own taking `warmup` silently got its own default instead."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(schedule=f"target: torch.optim.lr_scheduler.StepLR, step_size: 2, {given}",
                                max_steps=3))
    r = jobrun("analyze", plan)
    assert r.code == 1 and "plan.yaml:10:" in r.out and "warmup belong(s) to the schedule without a target" in r.out
    assert "warmup_steps" in r.out, r.text
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "jobrun does not pass them on" in r.err and not (tmp_path / "run").exists(), r.text


def test_ops_lists_the_schedule_and_print_shows_it(tmp_path):
    out = jobrun("ops", "scheduler").out
    for word in ("warmup", "decay", "min_ratio", "global step"):
        assert word in out
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(schedule="warmup: 5, steps: 25", max_steps=3))
    assert "sched = scheduler(opt, warmup=5, steps=25)" in jobrun("print", plan).out


LR_PLAN = """\
job: lr
max_epochs: 3
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: regression, n: 16, features: 3}}
      - model.mlp: {{out: model, sizes: [3, 4, 1]}}
      - optimizer: {{in: model, out: opt, lr: 0.1, groups: [{{ndim_below: 2, lr: 0.5}}]}}
      - scheduler: {{in: opt, out: sched, target: torch.optim.lr_scheduler.ReduceLROnPlateau, patience: 0}}
      - optimizer.rate: {{in: opt, out: first_lr}}
epoch:
  - task: train
    do:
      - train.step: {{in: [model, opt, x, y], out: loss, loss: mse}}
      - scheduler.step: {{in: [sched, 1.0]}}
      - optimizer.rate: {{{lr}}}
      - optimizer.rate: {{in: opt, out: bias_lr, group: 1}}
      - log: {{in: [lr, bias_lr]}}
    outputs: [loss, lr]
"""


def test_optimizer_lr_gives_each_groups_rate_as_the_scheduler_set_it(tmp_path):
    """Lightning's LearningRateMonitor: a plateau scheduler's changes were in no log unless
    a `call` read opt.param_groups[0]["lr"]."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(LR_PLAN.format(lr="in: opt, out: lr"))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    assert [(v["lr"], v["bias_lr"]) for v in logged(tmp_path / "run")] == [
        (0.1 * 0.1**k, 0.5 * 0.1**k) for k in range(3)]  # the metric never improves: x factor 0.1
    assert "lr=0.01" in r.out
    assert "lr = optimizer.rate(opt)" in jobrun("print", plan).out
    # beside it in init, `optimizer.lr` still names the optimizer's argument
    assert "optimizer(model, lr=0.2," in jobrun("print", plan, "init.setup.optimizer.lr=0.2").out


@pytest.mark.parametrize("call, message, hint", [
    ("in: sched, out: lr", "optimizer.rate expects an optimizer, got a ReduceLROnPlateau", "the scheduler's `in`"),
    ("in: opt, out: lr, group: 2", "group 2 is not one of the optimizer's 2 parameter group(s)", "group: 0 to 1"),
])
def test_optimizer_lr_of_what_has_no_such_rate_is_one_message(tmp_path, call, message, hint):
    plan = tmp_path / "plan.yaml"
    plan.write_text(LR_PLAN.format(lr=call))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code != 0 and message in r.err and hint in r.err and "plan.yaml:16:" in r.err, r.text
    assert "Traceback" not in r.text


def test_optimizer_lr_of_a_schedule_by_step_points_at_its_optimizer(tmp_path):
    # jobrun's own schedule (no `target`) has no step(): the hint said to create an optimizer.
    plan = tmp_path / "plan.yaml"
    plan.write_text(LR_PLAN.format(lr="in: sched, out: lr").replace(
        "target: torch.optim.lr_scheduler.ReduceLROnPlateau, patience: 0", "warmup: 2, steps: 6").replace(
        "      - scheduler.step: {in: [sched, 1.0]}\n", ""))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code != 0 and "optimizer.rate expects an optimizer, got a StepSchedule" in r.err, r.text
    assert "the scheduler's `in`" in r.err and "Traceback" not in r.text


@pytest.mark.parametrize("target, step, message, hint", [
    # StepLR.step(epoch) took val_loss as the epoch number: the rate stayed 0.1 for good
    ("StepLR, step_size: 1", "in: [sched, loss]", "StepLR takes no metric, but scheduler.step gives it one",
     "remove the second input: `scheduler.step: {in: sched}`"),
    ("ReduceLROnPlateau", "in: sched", "ReduceLROnPlateau steps on a metric, and scheduler.step gives it none",
     "`scheduler.step: {in: [sched, val_loss]}`"),
])
def test_a_metric_a_torch_scheduler_does_not_take_or_lacks_is_refused_before_the_run(
        tmp_path, target, step, message, hint):
    """A metric given to StepLR set the rate of 'epoch' val_loss in closed form, silently
    (the rate never fell); ReduceLROnPlateau without one failed after the first epoch with
    torch's TypeError and no hint."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(LR_PLAN.format(lr="in: opt, out: lr").replace(
        "ReduceLROnPlateau, patience: 0", target).replace("in: [sched, 1.0]", step))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "Traceback" not in r.text, r.text
    assert f"{plan}:15:9: error: scheduler.step: {message}" in r.err and hint in r.err, r.err
    assert not (tmp_path / "run").exists()


TWO_NODES = """\
job: two_scheds
max_epochs: 2
init:
  - task: a
    node: alpha
    do:
      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}
      - model.mlp: {out: model, sizes: [2, 1]}
      - optimizer: {in: model, out: opt, lr: 0.1}
      - scheduler: {in: opt, out: sched, target: torch.optim.lr_scheduler.StepLR, step_size: 1}
  - task: b
    node: beta
    do:
      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}
      - model.mlp: {out: model, sizes: [2, 1]}
      - optimizer: {in: model, out: opt, lr: 0.1}
      - scheduler: {in: opt, out: sched, target: torch.optim.lr_scheduler.ReduceLROnPlateau, patience: 0}
epoch:
  - task: ta
    node: alpha
    do:
      - train.step: {in: [model, opt, x, y], out: loss, loss: mse}
      - scheduler.step: {in: sched}
      - optimizer.rate: {in: opt, out: lr}
      - log: {in: [lr]}
    outputs: [loss]
  - task: tb
    node: beta
    do:
      - train.step: {in: [model, opt, x, y], out: loss, loss: mse}
      - scheduler.step: {in: [sched, 1.0]}
      - optimizer.rate: {in: opt, out: lr}
      - log: {in: [lr]}
    outputs: [loss]
"""


def test_a_sched_of_each_node_is_checked_against_its_own_scheduler(tmp_path):
    """Blobs are a node's: alpha's StepLR `sched` stepped without a metric was checked
    against beta's ReduceLROnPlateau `sched` (the last scheduler the plan named so) and
    the plan was refused before the run, though it runs."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(TWO_NODES)
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    lrs = sorted((v["_task"], v["_epoch"], round(v["lr"], 6)) for v in logged(tmp_path / "run"))
    assert lrs == [("ta", 1, 0.01), ("ta", 2, 0.001), ("tb", 1, 0.1), ("tb", 2, 0.01)]
