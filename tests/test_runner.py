"""The run semantics of PLAN_LANGUAGE.md §1 and §4, through `jobrun train` on small plans."""

from __future__ import annotations

import json

import pytest
from runner_util import ckpt_values, jobrun, logged, metrics


def train(plan_file, text: str, tmp_path, *extra: str):
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(text), "--run-dir", run_dir, *extra)
    return r, run_dir


COUNTER = """
job: counter
max_epochs: 10
stop_when: [done]
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - const: {out: total, value: 0}
      - const: {out: epochs, value: 0}
epoch:
  - task: count
    do:
      - add: {in: [epochs, 1], out: epochs}
      - loop: 4
        as: i
        do:
          - add: {in: [total, i], out: total}
      - ge: {in: [epochs, 3], out: done}
      - log: {in: [epochs, total], msg: counted}
    outputs: [total, done]
"""


def test_loop_as_and_stop_when(plan_file, tmp_path):
    r, run_dir = train(plan_file, COUNTER, tmp_path)
    assert r.code == 0, r.text
    rows = logged(run_dir, "counted")
    assert [(x["epochs"], x["total"]) for x in rows] == [(1, 6), (2, 12), (3, 18)]
    assert [x["_epoch"] for x in rows] == [1, 2, 3]
    assert all(x["_task"] == "count" for x in rows)
    # checkpoint 0 after init, then one per epoch; stop at epoch 3 (done), not 10
    assert ckpt_values(run_dir, 0) == {"epochs": 0, "total": 0}
    assert ckpt_values(run_dir, 3) == {"epochs": 3, "total": 18}
    assert "epoch 3/10" in r.out and "epoch 4" not in r.out


def test_max_epochs_without_checkpoints(plan_file, tmp_path):
    text = COUNTER.replace("checkpoint: {dir: ckpt}\n", "").replace(
        "ge: {in: [epochs, 3]", "ge: {in: [epochs, 99]"
    )
    r, run_dir = train(plan_file, text, tmp_path, "--set", "max_epochs=2")
    assert r.code == 0, r.text
    assert [x["epochs"] for x in logged(run_dir, "counted")] == [1, 2]
    assert not (run_dir / "ckpt").exists()


def test_private_workspace_semantics(plan_file, tmp_path):
    text = """
job: ws
max_epochs: 2
checkpoint: {}
init:
  - task: setup
    do:
      - const: {out: shared, value: 1}
epoch:
  - task: t
    do:
      - add: {in: [shared, 1], out: shared}    # exists globally: updates it
      - mul: {in: [shared, 10], out: scratch}   # new name: stays private
    outputs: [scratch]
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 0, r.text
    assert ckpt_values(run_dir, 2) == {"shared": 3}  # scratch was dropped with the task
    assert "scratch=30" in r.out  # ...but handed to the runner as an output


def test_if_elif_else(plan_file, tmp_path):
    text = """
job: branches
max_epochs: 4
init:
  - task: setup
    do:
      - const: {out: n, value: 0}
epoch:
  - task: t
    do:
      - add: {in: [n, 1], out: n}
      - eq: {in: [n, 1], out: one}
      - eq: {in: [n, 2], out: two}
      - if: one
        then: [{const: {out: which, value: 10}}]
        elif: [{if: two, then: [{const: {out: which, value: 20}}]}]
        else: [{const: {out: which, value: 30}}]
      - log: {in: [n, which]}
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 0, r.text
    assert [(x["n"], x["which"]) for x in logged(run_dir)] == [(1, 10), (2, 20), (3, 30), (4, 30)]


def test_stop_if_in_null_loop_and_outside_loop(plan_file, tmp_path):
    text = """
job: stops
max_epochs: 1
init:
  - task: setup
    do:
      - const: {out: i, value: 0}
epoch:
  - task: t
    do:
      - loop: null
        do:
          - add: {in: [i, 1], out: i}
          - ge: {in: [i, 5], out: enough}
          - stop_if: enough
      - log: {in: [i], msg: after-loop}
      - stop_if: enough
      - log: {in: [i], msg: never}
    exit:
      - log: {in: [i], msg: exit-ran}
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 0, r.text
    assert [x["i"] for x in logged(run_dir, "after-loop")] == [5]
    assert logged(run_dir, "never") == []
    assert [x["i"] for x in logged(run_dir, "exit-ran")] == [5]


def test_parallel_branches_and_instances(plan_file, tmp_path):
    text = """
job: conc
max_epochs: 1
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:new_list", out: seen}
epoch:
  - task: t
    instances: 3
    init:
      - call: {fn: "jobrun_test_helpers:append", in: [seen, 100]}
    do:
      - parallel:
          - name: left
            do: [{call: {fn: "jobrun_test_helpers:append", in: [seen, 1]}}]
          - do: [{call: {fn: "jobrun_test_helpers:append", in: [seen, 2]}}]
    exit:
      - call: {fn: "jobrun_test_helpers:length", in: [seen], out: n}
      - log: {in: [n]}
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 0, r.text
    # init once, then 3 instances x 2 branches, then exit once
    assert [x["n"] for x in logged(run_dir)] == [7]


def test_report_runs_in_background_and_at_end(plan_file, tmp_path):
    text = """
job: rep
max_epochs: 1
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:new_list", out: ticks}
epoch:
  - task: t
    do:
      - report: 10ms
        do: [{call: {fn: "jobrun_test_helpers:append", in: [ticks, 1]}}]
      - loop: 10
        do: [{call: {fn: "jobrun_test_helpers:sleep", in: [0.02]}}]
      - call: {fn: "jobrun_test_helpers:length", in: [ticks], out: during}
    exit:
      - call: {fn: "jobrun_test_helpers:length", in: [ticks], out: after}
      - log: {in: [during, after]}
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 0, r.text
    (row,) = logged(run_dir)
    assert row["during"] >= 2  # 200 ms of work under a 10 ms period
    assert (
        row["after"] == row["during"] + 1 or row["after"] >= row["during"] + 1
    )  # once more at the end


def test_concurrent_tasks_and_nodes(plan_file, tmp_path):
    text = """
job: nodes
max_epochs: 2
checkpoint: {}
init:
  - task: a
    node: alpha
    do: [{const: {out: x, value: 1}}]
  - task: b
    node: beta
    do: [{const: {out: x, value: 100}}]
epoch:
  - task: a
    node: alpha
    do: [{add: {in: [x, 1], out: x}}]
  - task: b
    node: beta
    do: [{add: {in: [x, 10], out: x}}]
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 0, r.text
    assert ckpt_values(run_dir, 2, "alpha") == {"x": 3}
    assert ckpt_values(run_dir, 2, "beta") == {"x": 120}


def test_randn_is_seeded_per_node(plan_file, tmp_path):
    text = """
job: rnd
max_epochs: 1
checkpoint: {include: r}  # init's draws, saved on every node to compare them
init:
  - task: a
    node: n1
    do: [{randn: {out: r, shape: [3]}}]
  - task: b
    node: n2
    do: [{randn: {out: r, shape: [3]}}]
epoch:
  - task: e
    node: n1
    do: [{copy: {in: r, out: r}}]
"""
    r1, d1 = train(plan_file, text, tmp_path)
    r2 = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "again")
    assert r1.code == 0 and r2.code == 0, r1.text + r2.text
    a, b = ckpt_values(d1, 1, "n1")["r"], ckpt_values(d1, 1, "n2")["r"]
    assert a != b  # each node draws its own stream
    assert ckpt_values(tmp_path / "again", 1, "n1")["r"] == a  # the same seed, the same values
    r3 = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "seed7", "--set", "seed=7")
    assert r3.code == 0 and ckpt_values(tmp_path / "seed7", 1, "n1")["r"] != a


def test_failing_op_names_position_task_and_node(plan_file, tmp_path):
    text = """
job: failing
max_epochs: 3
checkpoint: {}
init:
  - task: setup
    do: [{const: {out: n, value: 0}}]
epoch:
  - task: worker
    node: box
    do:
      - add: {in: [n, 1], out: n}
      - eq: {in: [n, 2], out: second}
      - if: second
        then:
          - call: {fn: "jobrun_test_helpers:fail", in: [n]}
"""
    r, run_dir = train(plan_file, text.replace("node: box", "node: local"), tmp_path)
    assert r.code == 1
    assert "plan.yaml:16:13" in r.err
    assert "task 'worker'" in r.err and "node 'local'" in r.err and "ValueError" in r.err
    assert "Traceback" not in r.text
    # the checkpoints written before the failure are intact
    assert ckpt_values(run_dir, 1) == {"n": 1}


def test_undefined_blob_at_run_time_is_an_analysis_error(plan_file, tmp_path):
    text = """
job: undefined
max_epochs: 1
epoch:
  - task: t
    do: [{add: {in: [nothing, 1], out: x}}]
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 2
    assert "plan.yaml:6:" in r.err and "nothing" in r.err
    assert not run_dir.exists()  # nothing written


def test_several_analysis_errors_each_come_with_their_hint(plan_file, tmp_path):
    text = """
job: two-errors
max_epochs: 1
epoch:
  - task: t
    do:
      - add: {in: [nothing, 1], out: x}
      - const: {out: y, value: 1, colour: red}
"""
    r, run_dir = train(plan_file, text, tmp_path)
    assert r.code == 2 and not run_dir.exists()
    lines = r.err.strip().splitlines()
    first = next(i for i, ln in enumerate(lines) if "plan.yaml:7:" in ln and "error" in ln)
    second = next(i for i, ln in enumerate(lines) if "plan.yaml:8:" in ln and "error" in ln)
    assert first < second
    assert lines[first + 1].startswith("  hint: ") and lines[second + 1].startswith("  hint: ")
    assert lines[-1] == "  hint: 2 errors; `jobrun analyze PLAN` lists them with the warnings"
    assert "Traceback" not in r.text


def test_refuses_run_dir_with_checkpoints(plan_file, tmp_path):
    r, run_dir = train(plan_file, COUNTER, tmp_path)
    assert r.code == 0
    again = jobrun("train", tmp_path / "plan.yaml", "--run-dir", run_dir)
    assert again.code == 2
    assert "already holds checkpoints" in again.err and "jobrun resume" in again.err
    assert ckpt_values(run_dir, 3) == {"epochs": 3, "total": 18}


def test_metrics_record_checkpoint_events(plan_file, tmp_path):
    r, run_dir = train(plan_file, COUNTER, tmp_path)
    assert r.code == 0
    saves = [m for m in metrics(run_dir) if m.get("event") == "checkpoint_save"]
    assert [m["epoch"] for m in saves] == [0, 1, 2, 3]
    assert all(m["bytes"] > 0 and m["seconds"] >= 0 for m in saves)


def test_resolved_plan_is_stored(plan_file, tmp_path):
    r, run_dir = train(plan_file, COUNTER, tmp_path, "--set", "max_epochs=2")
    assert r.code == 0
    import yaml

    stored = yaml.safe_load((run_dir / "plan.yaml").read_text())
    assert stored["max_epochs"] == 2
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["last_epoch"] == 2


@pytest.mark.parametrize("bad", ["--device=gpu", "--replicas=0"])
def test_bad_cli_options(plan_file, tmp_path, bad):
    r = jobrun("train", plan_file(COUNTER), "--run-dir", tmp_path / "r", bad)
    assert r.code == 2
    assert "Traceback" not in r.text


def test_tensorboard_events_when_installed(plan_file, tmp_path):
    pytest.importorskip("tensorboard")
    r, run_dir = train(plan_file, COUNTER, tmp_path)
    assert r.code == 0, r.text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("count/total")] == [6.0, 12.0, 18.0]
    # at the global step: optimizer steps taken, none in this plan
    assert [e.step for e in acc.Scalars("count/epochs")] == [0, 0, 0]


def test_a_thread_count_that_is_not_a_number_is_one_clear_error(plan_file, tmp_path, monkeypatch):
    monkeypatch.setenv("JOBRUN_THREADS", "two")
    r, run_dir = train(plan_file, COUNTER, tmp_path)
    assert r.code == 2
    assert "JOBRUN_THREADS='two' is not a number" in r.err
    assert "set it to the number of CPU threads torch may use" in r.err
    assert "Traceback" not in r.text and not (run_dir / "ckpt").exists()
