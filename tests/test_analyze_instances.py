"""`instances: N` training one shared model (it crashed in autograd every time) is an
analyze error, so `train` refuses it before anything runs; an instance's own model is fine."""

from __future__ import annotations

import json

from runner_util import jobrun

PLAN = """\
job: inst
max_epochs: 1
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 4, classes: 2, seed: 0}
      - reader: {in: [x, y], out: data, batch_size: 8, passes: 0}
      - model.mlp: {out: model, sizes: [4, 8, 2]}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    instances: 2
    do:
STEPS"""

SHARED = """\
      - loop: null
        do:
          - read: {in: data, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss}
"""

OWN = """\
      - model.mlp: {out: mine, sizes: [4, 8, 2]}
      - optimizer: {in: mine, out: my_opt, lr: 0.1}
      - read: {in: data, out: [xb, yb, end]}
      - train.step: {in: [mine, my_opt, xb, yb], out: loss}
      - train.step: {in: [mine, opt, xb, yb], out: loss2}
"""


def _found(r):
    return [d for d in json.loads(r.out)["diagnostics"] if d["code"] == "instance-training"]


def test_analyze_refuses_instances_that_train_one_shared_model(plan_file):
    r = jobrun("analyze", plan_file(PLAN.replace("STEPS", SHARED)), "--format", "json")
    found = _found(r)
    assert [(d["severity"], d["line"]) for d in found] == [("error", 18)]
    assert ("the 2 instances of task 'train' all change 'model' and 'opt' with `train.step` at once"
            in found[0]["message"])
    assert "autograd" in found[0]["message"] and "replicas" in found[0]["hint"]


def test_train_stops_before_running_such_a_plan(plan_file, tmp_path):
    r = jobrun("train", plan_file(PLAN.replace("STEPS", SHARED)), "--run-dir", tmp_path / "run")
    assert r.code == 2 and "all change 'model' and 'opt'" in r.err and "Traceback" not in r.text
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_each_instances_own_model_is_fine_but_a_shared_optimizer_is_not(plan_file):
    found = _found(jobrun("analyze", plan_file(PLAN.replace("STEPS", OWN)), "--format", "json"))
    assert [(d["line"], d["message"].split(" with ")[0]) for d in found] == [
        (18, "the 2 instances of task 'train' all change 'opt'")]
