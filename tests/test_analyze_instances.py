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


def test_a_name_an_instance_creates_stays_in_the_instance(tmp_path):
    """Each instance has a workspace of its own: what it creates is gone when it ends
    (updates of existing global blobs stay). analyze said ok, and train failed after
    making the run directory ("blob 'w' is not defined", "ended without defining its
    output")."""
    made_in_init = """\
job: inst
max_epochs: 1
init:
  - task: setup
    instances: 2
    workspace: global
    do:
      - const: {out: w, value: 1}
epoch:
  - task: t
    do:
      - add: {in: [w, 1], out: v}
      - log: {in: [v]}
"""
    (tmp_path / "a.yaml").write_text(made_in_init)
    r = jobrun("analyze", tmp_path / "a.yaml")
    assert r.code == 1 and "a.yaml:12:20: error: blob 'w' is read before it is defined" in r.out, r.out
    assert "in task 'setup', whose 2 instances each have a workspace of their own" in r.out
    output = made_in_init.replace("  - task: t\n    do:\n      - add: {in: [w, 1], out: v}\n      - log: {in: [v]}\n",
                                  "  - task: t\n    instances: 2\n    do:\n      - const: {out: made, value: 2}\n"
                                  "    outputs: [made]\n")
    (tmp_path / "b.yaml").write_text(output)
    r = jobrun("analyze", tmp_path / "b.yaml")
    assert r.code == 1 and "error: output 'made' of task 't' is never defined in the task" in r.out, r.out
    updated = made_in_init.replace("    instances: 2\n    workspace: global\n    do:\n      - const: {out: w, value: 1}\n",
                                   "    do:\n      - const: {out: w, value: 1}\n  - task: more\n    instances: 2\n"
                                   "    workspace: global\n    do:\n      - add: {in: [w, 1], out: w}\n")
    (tmp_path / "c.yaml").write_text(updated)
    r = jobrun("analyze", tmp_path / "c.yaml")
    assert "'w' is read before it is defined" not in r.out, r.out  # an update stays
