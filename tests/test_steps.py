"""The global step: counted over optimizer steps, `every: N` on any step, `max_steps`."""

from __future__ import annotations

import json

import pytest
from runner_util import jobrun, metrics

PLAN = """\
job: steps
{top}
checkpoint: {{dir: ckpt}}
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: regression, n: 8, features: 2}}
      - model.mlp: {{out: model, sizes: [2, 1]}}
      - optimizer: {{in: model, out: opt, lr: 0.01}}
      - const: {{out: seen, value: 0}}
epoch:
  - task: train
    do:
{do}
download:
  - task: after
    do: [{{log: {{in: [seen], msg: download}}}}]
"""


def write(tmp_path, top: str, do: str):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(top=top, do=do))
    return plan


def values(run, key: str = "values") -> list[tuple]:
    return [(r["epoch"], r["step"], r["values"]) for r in metrics(run) if key in r]


def test_max_steps_ends_the_epoch_mid_loop_then_saves_downloads_and_exits(tmp_path):
    do = """\
      - loop: 4
        do:
          - train.step: {in: [model, opt, x, y], out: loss, loss: mse}
          - add: {in: [seen, 1], out: seen}
      - log: {in: [seen], msg: after the loop}"""
    plan = write(tmp_path, "max_steps: 10", do)
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    records = metrics(run)
    # 4 + 4 + 2 steps: the third epoch's loop ends as its 3rd iteration begins, the step
    # after the loop still runs (seen counts the iterations that ran)
    logs = [(r["epoch"], r["step"], r["msg"], r["values"]["seen"]) for r in records if "values" in r]
    assert logs == [(1, 4, "after the loop", 4), (2, 8, "after the loop", 8),
                    (3, 10, "after the loop", 10), (3, 10, "download", 10)]
    assert [r["step"] for r in records if r.get("event") == "epoch"] == [4, 8, 10]
    assert sorted(p.name for p in (run / "ckpt").iterdir() if not p.name.startswith(".")) == \
        ["local.0", "local.1", "local.2", "local.3"]
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    # resumed from epoch 2 it takes the same last 2 steps, and a finished run stops at once
    assert jobrun("resume", "--run-dir", run, "--epoch", "2").code == 0
    assert [(r["epoch"], r["step"]) for r in metrics(run) if r.get("event") == "epoch"] == \
        [(1, 4), (2, 8), (3, 10)]
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0 and "epoch 4" not in r.text
    assert f"train on with `jobrun resume {run} max_steps=N`" in r.out  # not max_epochs, which did not stop it


def test_resume_with_a_larger_max_steps_goes_on_without_a_warning_to_the_same_model(tmp_path):
    # It warned "the plan changed beyond max_epochs: the result is no longer the one an
    # uninterrupted run would give", though the steps go on exactly.
    do = """\
      - loop: 4
        do:
          - train.step: {in: [model, opt, x, y], out: loss, loss: mse}"""
    plan = write(tmp_path, "max_steps: 6", do)
    run, straight = tmp_path / "run", tmp_path / "straight"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    r = jobrun("resume", "--run-dir", run, "max_steps=10")
    assert r.code == 0, r.text
    assert "resuming with max_steps: 6 -> 10" in r.err and "warning" not in r.err
    assert "an epoch the old max_steps cut short is not finished" in r.err
    assert [r["step"] for r in metrics(run) if r.get("event") == "epoch"] == [4, 6, 10]
    assert jobrun("train", plan, "--run-dir", straight, "max_steps=10").code == 0
    shown = [jobrun("ckpt", "show", d, "--blob", "model", "--blob", "opt", "--values", "--json").out
             for d in (run, straight)]
    assert shown[0] == shown[1] and '"model"' in shown[0]


def test_a_loop_that_takes_no_step_runs_to_its_end_after_max_steps(tmp_path):
    do = """\
      - loop: 4
        do: [{train.step: {in: [model, opt, x, y], out: loss, loss: mse}}]
      - loop: 3
        do: [{add: {in: [seen, 1], out: seen}}]
      - log: {in: [seen], msg: evaluated}"""
    plan = write(tmp_path, "max_steps: 6", do)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    # epoch 2's training loop stops at step 6; the loop after it still runs its 3 times
    assert [(e, s, v["seen"]) for e, s, v in values(run) if "seen" in v][:2] == [(1, 4, 3), (2, 6, 6)]


def test_a_plan_may_stop_on_max_steps_alone_and_it_must_be_a_count(tmp_path):
    do = "      - loop: null\n        do: [{train.step: {in: [model, opt, x, y], out: loss, loss: mse}}]"
    plan = write(tmp_path, "max_steps: 3", do)
    r = jobrun("analyze", plan)
    assert r.code == 0, r.text
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    assert [(r["epoch"], r["step"]) for r in metrics(run) if r.get("event") == "epoch"] == [(1, 3)]
    bad = write(tmp_path, "max_steps: 0", do)
    r = jobrun("analyze", bad)
    assert r.code != 0 and "plan.yaml:2:" in r.text and "max_steps is 0" in r.text
    typo = write(tmp_path, "max_step: 3", do)
    r = jobrun("analyze", typo)
    assert r.code != 0 and "max_steps" in r.text  # did you mean


def test_the_global_step_counts_optimizer_steps_a_call_takes(tmp_path):
    do = """\
      - loop: 3
        do:
          - call: {fn: "jobrun_test_helpers:own_step", in: [model, opt], mutates: [model, opt]}
          - log: {in: [seen]}"""
    plan = write(tmp_path, "max_epochs: 2", do)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0, run
    assert [s for _, s, v in values(run) if "seen" in v][:6] == [0, 1, 2, 3, 4, 5]


def test_every_on_control_steps_and_ops_runs_at_multiples_of_the_step(tmp_path):
    do = """\
      - loop: 5
        do:
          - if: going
            every: 2
            then: [{add: {in: [seen, 1], out: seen}}]
          - const: {out: going, value: true}
          - train.step: {in: [model, opt, x, y], out: loss, loss: mse}
          - log: {in: [seen], every: 3}"""
    text = PLAN.format(top="max_epochs: 2", do=do).replace(
        "      - const: {out: seen, value: 0}",
        "      - const: {out: seen, value: 0}\n      - const: {out: going, value: true}")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    # the if runs at steps 0, 2, 4, 6, 8; the log at 0, 3, 6, 9 (each after that iteration's if)
    assert [(s, v["seen"]) for _, s, v in values(run) if "seen" in v][:4] == [(0, 1), (3, 2), (6, 4), (9, 5)]
    printed = jobrun("print", plan).out
    assert "if going:  # every 2 steps" in printed and "log(seen)  # every 3 steps" in printed
    shown = json.loads(jobrun("print", plan, "--format", "json").out)
    loop = shown["groups"][1]["tasks"][0]["do"][0]
    assert [s["every_steps"] for s in loop["do"]] == [2, None, None, 3]


@pytest.mark.parametrize("step, where", [
    ("- loop: 2\n        evrey: 2\n        do: [{const: {out: a, value: 1}}]", "did you mean 'every'"),
    ("- if: seen\n        every: -1\n        then: [{const: {out: a, value: 1}}]", "every is -1"),
    ("- const: {out: a, value: 1, every: two}", "every must be an integer"),
])
def test_bad_every_is_one_message_at_its_place(tmp_path, step, where):
    plan = write(tmp_path, "max_epochs: 1", "      " + step)
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and where in r.err and "plan.yaml:1" in r.err and "Traceback" not in r.text
    assert not (tmp_path / "run").exists()


def test_print_shows_max_steps_in_the_header_and_the_epoch_condition(tmp_path):
    plan = write(tmp_path, "max_steps: 7", "      - const: {out: a, value: 1}")
    out = jobrun("print", plan).out
    assert "max_steps: 7" in out and "epoch (repeat until step 7):" in out
    assert json.loads(jobrun("print", plan, "--format", "json").out)["max_steps"] == 7


def test_a_call_that_asks_for_the_step_gets_the_global_step(tmp_path):
    do = """\
      - loop: 3
        do:
          - train.step: {in: [model, opt, x, y], out: loss, loss: mse}
          - call: {fn: "jobrun_test_helpers:the_step", out: now, pure: true}
          - log: {in: [now]}"""
    plan = write(tmp_path, "max_epochs: 2", do)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    # the step its loop's iteration began at, as `log` sees it
    assert [(s, v["now"]) for _, s, v in values(run) if "now" in v] == [(k, k) for k in range(6)]


def test_analyze_suggests_every_for_a_typo_in_an_op_call(tmp_path):
    plan = write(tmp_path, "max_epochs: 1", "      - log: {in: [seen], evrey: 10}")
    r = jobrun("analyze", plan)
    assert r.code == 1 and "`log` has no argument `evrey`" in r.out and "did you mean 'every'" in r.out
