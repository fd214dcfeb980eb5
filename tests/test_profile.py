"""`train --profile` / `resume --profile`: the time of every plan step, and a torch trace."""

from __future__ import annotations

import json

import pytest
from jobrun_test_helpers import mlp_plan
from runner_util import jobrun

from jobrun.plans.compile import compile_text
from jobrun.runner.executor import CompiledTask, NodeRuntime
from jobrun.runner.profile import Profile

PLAN = mlp_plan("prof", "max_epochs: 3\ncheckpoint: {dir: ckpt}", n=96, batch=16,
                init=["const: {out: loss, value: 0.0}"], epoch=["log: {in: [loss]}"], outputs="[loss]")


def _train(plan_file, tmp_path, *extra: str):
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(PLAN), "--run-dir", run_dir, *extra)
    assert r.code == 0, r.text
    return r, run_dir


def _rows(run_dir, group: str) -> dict[str, dict]:
    data = json.loads((run_dir / "profile.json").read_text())
    (g,) = [g for g in data["groups"] if g["group"] == group]
    return g, {f"{r['task']} {r['step']}": r for r in g["rows"]}


def test_profile_times_every_step_per_task_and_group(plan_file, tmp_path):
    r, run_dir = _train(plan_file, tmp_path, "--profile")
    epoch, rows = _rows(run_dir, "epoch")
    assert epoch["runs"] == 3  # three epochs
    # 96 records in batches of 16: 6 batches and the end read, each epoch.
    assert rows["train read"]["calls"] == 3 * 7
    assert rows["train train.step"]["calls"] == 3 * 6
    assert rows["train loop"]["calls"] == 3
    assert rows["train log"]["calls"] == 3
    assert rows["train (task)"]["calls"] == 3
    totals = [row["total_s"] for row in epoch["rows"]]
    assert totals == sorted(totals, reverse=True)  # the slowest first
    # A step's time is part of its loop's, which is part of its task's, part of the group's.
    assert rows["train train.step"]["total_s"] <= rows["train loop"]["total_s"]
    assert rows["train loop"]["total_s"] <= rows["train (task)"]["total_s"] <= epoch["total_s"]
    step = rows["train train.step"]
    assert step["mean_ms"] == pytest.approx(step["total_s"] / step["calls"] * 1000, rel=1e-3)
    assert step["share"] == pytest.approx(step["total_s"] / epoch["total_s"], abs=1e-3)
    assert step["where"].startswith("plan.yaml:")
    _, init = _rows(run_dir, "init")
    assert init["setup model.mlp"]["calls"] == 1
    # The table is printed at the end and written as text too.
    text = (run_dir / "profile.txt").read_text()
    assert "train.step" in text and "epoch (3 times)" in text
    assert "profile: time per plan step" in r.out and str(run_dir / "profile.txt") in r.out


def test_without_profile_the_generated_code_is_untimed_and_no_file_is_written(plan_file, tmp_path):
    _, run_dir = _train(plan_file, tmp_path)
    assert not (run_dir / "profile.json").exists()
    plan = compile_text(PLAN)
    (task,) = plan.epoch.tasks
    node = NodeRuntime("local", __import__("jobrun.ops.context", fromlist=["OpContext"]).OpContext())
    plain = CompiledTask(task, node)
    timed = CompiledTask(task, node, Profile())
    assert "clock()" not in _source(plain) and "clock()" in _source(timed)


def _source(t: CompiledTask) -> str:
    import linecache

    return "".join(linecache.getlines(t._do.__code__.co_filename))


def test_resume_profile_covers_the_resumed_epochs(plan_file, tmp_path):
    _, run_dir = _train(plan_file, tmp_path, "max_epochs=1")
    r = jobrun("resume", "--run-dir", run_dir, "max_epochs=3", "--profile")
    assert r.code == 0, r.text
    epoch, rows = _rows(run_dir, "epoch")
    assert epoch["runs"] == 2 and rows["train train.step"]["calls"] == 2 * 6


def test_profile_leaves_an_override_or_a_run_directory_after_it_alone(plan_file, tmp_path):
    # `--profile` takes a word only when it is steps or torch (click took any word and
    # refused it: "'max_epochs=1' is not one of 'steps', 'torch'").
    _, run_dir = _train(plan_file, tmp_path, "--profile", "max_epochs=1")
    epoch, rows = _rows(run_dir, "epoch")
    assert epoch["runs"] == 1 and rows["train train.step"]["calls"] == 6
    r = jobrun("resume", "--profile", run_dir, "max_epochs=2")
    assert r.code == 0, r.text
    epoch, rows = _rows(run_dir, "epoch")
    assert epoch["runs"] == 1 and rows["train train.step"]["calls"] == 6  # epoch 2 only
    assert "resumed from checkpoint epoch 1" in r.out


def test_profile_torch_writes_a_chrome_trace_of_steady_steps(plan_file, tmp_path):
    r, run_dir = _train(plan_file, tmp_path, "--profile-steps", "3")
    (trace,) = (run_dir / "profile").glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::addmm" in n or "aten::linear" in n for n in names)
    assert "torch trace:" in r.out


def test_profile_torch_with_too_few_steps_says_so(plan_file, tmp_path):
    r, run_dir = _train(plan_file, tmp_path, "--profile", "torch", "max_epochs=1")
    # 7 iterations of the loop in one epoch: 5 skipped, 2 traced of the 5 asked for.
    assert "only (the run ended first)" in r.text
    assert len(list((run_dir / "profile").glob("*.pt.trace.json"))) == 1


def test_bad_profile_option_is_one_clear_error(plan_file, tmp_path):
    r = jobrun("train", plan_file(PLAN), "--run-dir", tmp_path / "run", "--profile=gpu")
    assert r.code == 2 and "'gpu' is not one of 'steps', 'torch'" in r.text


def test_a_failed_run_still_prints_and_writes_its_profile(plan_file, tmp_path):
    failing = PLAN.replace("      - log: {in: [loss]}\n",
                           "      - log: {in: [loss]}\n      - call: {fn: \"jobrun_test_helpers:fail\"}\n")
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(failing), "--run-dir", run_dir, "--profile")
    assert r.code == 1 and "boom" in r.text
    _, rows = _rows(run_dir, "epoch")
    assert rows["train train.step"]["calls"] == 6 and "train call" not in rows  # it raised
    assert "profile: time per plan step" in r.out


def test_profile_times_parallel_branches_and_instances(plan_file, tmp_path):
    text = """
job: conc
max_epochs: 2
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:new_list", out: seen}
epoch:
  - task: t
    instances: 3
    do:
      - parallel:
          - name: left
            do: [{call: {fn: "jobrun_test_helpers:sleep", seconds: 0.01}}]
          - do: [{call: {fn: "jobrun_test_helpers:append", in: [seen, 2]}}]
"""
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(text), "--run-dir", run_dir, "--profile")
    assert r.code == 0, r.text
    group, _ = _rows(run_dir, "epoch")
    calls = sorted((row["where"], row["calls"], row["total_s"]) for row in group["rows"] if row["step"] == "call")
    # 2 epochs x 3 instances, each branch once (a lost update from the threads would show).
    assert [c for _, c, _ in calls] == [6, 6]
    assert calls[0][2] >= 6 * 0.01  # each sleep (line 14) is inside its own timing
