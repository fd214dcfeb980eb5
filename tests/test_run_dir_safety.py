"""What jobrun refuses to write over: checkpoints, files it did not write, links, FIFOs.

Each test does what a user (or someone who can write into a run directory) did, then
asserts that nothing that was there is lost or written through, with one clear message.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from runner_util import HANG_S, jobrun

PLAN = """\
job: counter
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do: [{const: {out: total, value: 0}}]
epoch:
  - task: count
    do:
      - add: {in: [total, 1], out: total}
      - log: {in: [total]}
    outputs: [total]
"""


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under root (not following links) and its content's digest."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                out[str(p.relative_to(root))] = "special"
            else:
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def trained(tmp_path):
    """A finished run with checkpoints 0..2, and its plan file."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    return plan, run


def _no_traceback(r) -> None:
    assert "Traceback" not in r.text


@pytest.mark.parametrize("damage", ["missing", "garbage", "not-an-object"])
def test_checkpoints_are_never_trained_over_whatever_run_json_says(trained, damage):
    plan, run = trained
    info = run / "run.json"
    if damage == "missing":
        info.unlink()
    elif damage == "garbage":
        info.write_text("{not json")
    else:
        info.write_text("[1, 2]")
    before = _snapshot(run)
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 2
    assert "already holds checkpoints" in r.err and "jobrun resume " in r.err
    _no_traceback(r)
    assert _snapshot(run) == before


def test_checkpoints_in_a_nested_directory_are_found(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("{dir: ckpt}", "{dir: deep/er/ckpt}"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    (run / "run.json").unlink()
    before = _snapshot(run)
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 2 and "already holds checkpoints" in r.err
    assert _snapshot(run) == before


def test_an_absolute_checkpoint_dir_holding_checkpoints_is_not_trained_over(tmp_path):
    shared = tmp_path / "shared-ckpt"
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("{dir: ckpt}", f"{{dir: {shared}}}"))
    assert jobrun("train", plan, "--run-dir", tmp_path / "first").code == 0
    before = _snapshot(shared)
    r = jobrun("train", plan, "--run-dir", tmp_path / "second")
    assert r.code == 2
    assert f"checkpoint directory {shared} already holds checkpoints" in r.err
    # not "continue it with `jobrun resume second`": second is no run; and --overwrite,
    # given, deletes only a run's own checkpoints
    assert "another run's" in r.err and "set checkpoint.dir" in r.err and "jobrun resume" not in r.err
    r = jobrun("train", plan, "--run-dir", tmp_path / "second", "--overwrite")
    assert r.code == 2 and "another run's" in r.err and "add --overwrite" not in r.err, r.err
    assert _snapshot(shared) == before
    assert not (tmp_path / "second").exists()  # refused before anything was created


def test_run_dir_next_to_the_plan_is_refused_and_the_plan_kept(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    plan = project / "plan.yaml"
    plan.write_text("# my comments\n" + PLAN)
    (project / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = _snapshot(project)
    monkeypatch.chdir(project)
    r = jobrun("train", "plan.yaml", "--run-dir", ".", "--set", "max_epochs=1")
    assert r.code == 2
    assert "is not empty and is not a jobrun run directory" in r.err
    _no_traceback(r)
    assert _snapshot(project) == before


def test_a_foreign_non_empty_directory_is_refused(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "data"
    run.mkdir()
    (run / "plan.yaml").write_text("someone else's file\n")
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 2 and "not a jobrun run directory" in r.err
    assert (run / "plan.yaml").read_text() == "someone else's file\n"
    assert sorted(p.name for p in run.iterdir()) == ["plan.yaml"]


def test_an_empty_directory_and_a_run_without_checkpoints_can_be_trained_in(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("checkpoint: {dir: ckpt}\n", ""))
    run = tmp_path / "run"
    run.mkdir()
    assert jobrun("train", plan, "--run-dir", run).code == 0
    first = (run / "metrics.jsonl").read_text()
    # A run without checkpoints starts again from scratch: its own metrics start over.
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    assert (run / "metrics.jsonl").read_text().count('"values"') == first.count('"values"') == 2


@pytest.mark.parametrize("name", [".lock", "run.json", "metrics.jsonl", "plan.yaml"])
def test_a_symlink_in_the_run_dir_is_never_written_through(tmp_path, name):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("checkpoint: {dir: ckpt}\n", ""))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0  # a jobrun run, no checkpoints
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    target = run / name
    target.unlink(missing_ok=True)
    target.symlink_to(victim)
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code != 0
    assert "symlink" in r.err or "not a jobrun run directory" in r.err
    _no_traceback(r)
    assert victim.read_text() == "precious\n"
    assert target.is_symlink()


def test_a_lock_symlink_is_refused_on_resume_too(trained, tmp_path):
    plan, run = trained
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / ".lock").unlink()
    (run / ".lock").symlink_to(victim)
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 2 and "symlink" in r.err
    assert victim.read_text() == "precious\n"


def test_a_fifo_for_metrics_is_an_error_not_a_hang(trained):
    plan, run = trained
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 2 and "FIFO" in r.err
    _no_traceback(r)


def test_a_hard_link_to_a_users_file_is_replaced_not_written_through(trained, tmp_path):
    plan, run = trained
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / "metrics.jsonl").unlink()
    os.link(victim, run / "metrics.jsonl")
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 0, r.text
    assert victim.read_text() == "precious\n"
    assert '"values"' in (run / "metrics.jsonl").read_text()  # a new file of its own


def test_a_hard_link_is_never_appended_to(tmp_path):
    from jobrun import safefs

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.link(victim, tmp_path / "metrics.jsonl")
    with pytest.raises(safefs.UnsafeFile, match="hard links"):
        safefs.open_write(tmp_path / "metrics.jsonl", append=True)
    assert victim.read_text() == "precious\n"


def test_a_refused_device_creates_nothing(tmp_path):
    import torch

    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has a cuda:7")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    r = jobrun("train", plan, "--run-dir", tmp_path / "run", "--device", "cuda:7")
    assert r.code == 2 and "cuda:7" in r.err
    assert not (tmp_path / "run").exists()


def test_a_read_only_run_dir_is_one_clear_message(tmp_path, monkeypatch):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if "ro" in self.parts:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    r = jobrun("train", plan, "--run-dir", tmp_path / "ro" / "run")
    assert r.code == 2
    assert "Read-only file system" in r.err and "writable" in r.err
    _no_traceback(r)


def test_resume_of_a_run_on_a_read_only_disk_is_one_clear_message(trained, monkeypatch):
    plan, run = trained
    from jobrun import safefs

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(safefs, "open_lock", read_only)
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 2 and "Read-only file system" in r.err
    assert f"hint: make {run} writable" in r.err, r.err  # another --run-dir cannot resume it
    _no_traceback(r)


def test_copied_run_resumes(trained, tmp_path):
    """A run copied elsewhere is still a jobrun run directory (run.json travels with it)."""
    plan, run = trained
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    info = json.loads((copy / "run.json").read_text())
    assert info["job"] == "counter"
    r = jobrun("resume", "--run-dir", copy, "--epoch", "1")
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 1" in r.out


# -- export and ckpt show: clear messages, valid JSON ----------------------------------------

INF_PLAN = """\
job: inf
max_epochs: 1
checkpoint: {dir: ckpt, include: [big, nan, neg, name]}  # init's products, saved anyway
init:
  - task: setup
    do:
      - fill: {out: one, shape: [2], value: 1.0}
      - fill: {out: zero, shape: [2], value: 0.0}
      - div: {in: [one, zero], out: big}
      - mul: {in: [zero, big], out: nan}
      - sub: {in: [zero, big], out: neg}
      - const: {out: name, value: hello}
epoch:
  - task: t
    do: [{const: {out: x, value: 1}}]
"""


@pytest.fixture
def inf_run(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(INF_PLAN)
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    return run


def test_ckpt_show_json_and_export_json_are_valid_json(inf_run, tmp_path):
    r = jobrun("ckpt", "show", inf_run, "--epoch", "1", "--json")
    assert r.code == 0, r.text
    values = json.loads(r.out, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    local = values["nodes"]["local"]
    assert (local["big"], local["nan"], local["neg"]) == (["inf"] * 2, ["nan"] * 2, ["-inf"] * 2)
    out = tmp_path / "out.json"
    r = jobrun("export", inf_run, "--epoch", "1", "--blob", "big", "--blob", "neg", "-o", out)
    assert r.code == 0, r.text
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert data == {"big": ["inf", "inf"], "neg": ["-inf", "-inf"]}


def test_export_of_a_value_without_tensors_to_safetensors_is_refused(inf_run, tmp_path):
    out = tmp_path / "out.safetensors"
    r = jobrun("export", inf_run, "--epoch", "1", "--blob", "name", "-o", out)
    assert r.code == 2
    assert "blob 'name' holds a str, no tensor" in r.err and ".json" in r.err
    assert not out.exists()


def test_export_into_a_missing_directory_is_one_clear_message(inf_run, tmp_path):
    r = jobrun("export", inf_run, "--epoch", "1", "--blob", "big", "-o", tmp_path / "nope" / "x.json")
    assert r.code == 2 and "does not exist" in r.err
    _no_traceback(r)


def test_export_into_an_unwritable_directory_is_one_clear_message(inf_run, tmp_path, monkeypatch):
    from jobrun import safefs

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(safefs, "create_new", refuse)
    r = jobrun("export", inf_run, "--epoch", "1", "--blob", "big", "-o", tmp_path / "x.json")
    assert r.code == 2 and "Read-only file system" in r.err
    _no_traceback(r)


# -- run.json says how a run ended ---------------------------------------------------------


def test_run_json_records_finished_failed_and_resumed(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("      - log: {in: [total]}\n",
                                 "      - call: {fn: \"jobrun_test_helpers:fail_once\", path: \"${run_dir}/../failed\"}\n"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 1
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and info["last_epoch"] == 0  # epoch 1 failed: 0 is the last complete
    assert "bad luck" in info["error"]
    assert info["error_at"] == f"{plan}:11:9"  # the failing call
    r = jobrun("resume", "--run-dir", run)
    info = json.loads((run / "run.json").read_text())
    assert r.code == 0, r.text
    assert info["status"] == "finished" and info["error"] is None and info["last_epoch"] == 2


def test_a_full_disk_for_run_json_is_a_warning_not_a_crash(trained, monkeypatch, capsys):
    plan, run = trained
    from jobrun import safefs

    real = safefs.write_atomic

    def full(path, data, **kw):
        if path.name == "run.json" and b'"finished"' in data:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data, **kw)

    monkeypatch.setattr(safefs, "write_atomic", full)
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 0, r.text
    assert "was not recorded" in r.err and "No space left" in r.err


# -- train --overwrite ---------------------------------------------------------------------


def test_overwrite_replaces_a_jobrun_run(trained):
    plan, run = trained
    (run / "ckpt" / "local.7" / "rank-0").mkdir(parents=True)  # an epoch the new run won't write
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "max_epochs=1")
    assert r.code == 0, r.text
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["local.0", "local.1"]
    assert json.loads((run / "run.json").read_text())["sets"] == ["max_epochs=1"]
    assert (run / "metrics.jsonl").read_text().count('"values"') == 1


def test_overwrite_also_replaces_the_runs_own_absolute_checkpoint_dir(tmp_path):
    shared = tmp_path / "elsewhere"
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("{dir: ckpt}", f"{{dir: {shared}}}"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "max_epochs=1")
    assert r.code == 0, r.text
    assert sorted(p.name for p in shared.iterdir()) == [".lock", "local.0", "local.1"]  # the run's lock


@pytest.mark.parametrize("what", ["foreign", "checkpoints without run.json"])
def test_overwrite_refuses_what_is_not_a_jobrun_run(trained, tmp_path, what):
    plan, run = trained
    if what == "foreign":
        run = tmp_path / "data"
        run.mkdir()
        (run / "thesis.tex").write_text("years of work\n")
    else:
        (run / "run.json").unlink()
    before = _snapshot(run)
    r = jobrun("train", plan, "--run-dir", run, "--overwrite")
    assert r.code == 2
    assert "not a jobrun run directory" in r.err
    assert _snapshot(run) == before


def test_refusal_hint_offers_resume_and_overwrite(trained):
    plan, run = trained
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 2
    assert f"jobrun resume {run}" in r.err and "--overwrite" in r.err


# -- resume with overrides -----------------------------------------------------------------


def test_resume_max_epochs_extends_a_finished_run_exactly(trained, tmp_path):
    plan, run = trained
    r = jobrun("resume", "--run-dir", run, "max_epochs=4")
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 2" in r.out and "epoch 4/4" in r.out
    assert "resuming with max_epochs: 2 -> 4" in r.err and "warning" not in r.err
    straight = tmp_path / "straight"
    assert jobrun("train", plan, "--run-dir", straight, "max_epochs=4").code == 0
    show = [jobrun("ckpt", "show", d, "--epoch", "4", "--json").out for d in (run, straight)]
    assert show[0] == show[1]
    info = json.loads((run / "run.json").read_text())
    assert info["sets"] == ["max_epochs=4"] and info["status"] == "finished"
    assert info["changes"] == [{"from_epoch": 2, "sets": ["max_epochs=4"],
                                "changed": ["max_epochs: 2 -> 4"]}]
    # the run goes on with its new plan: a later resume keeps max_epochs 4
    again = jobrun("resume", "--run-dir", run)
    assert again.code == 0 and "already finished at epoch 4" in again.out


def test_resume_shows_a_var_and_the_values_it_gives_and_extends_without_a_warning(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("max_epochs: 2", 'vars: {epochs: 2, step: 1}\nmax_epochs: "${epochs}"')
                    .replace("[total, 1]", '[total, "${step}"]'))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    r = jobrun("resume", "--run-dir", run, "vars.epochs=3")
    assert r.code == 0, r.text
    # the var, then what it changed with its values (the template "${epochs}" was shown)
    assert "resuming with vars.epochs: 2 -> 3\nresuming with max_epochs: 2 -> 3\n" in r.err
    assert "warning" not in r.err and "epoch 3/3" in r.out  # only max_epochs changed: exact
    r = jobrun("resume", "--run-dir", run, "max_epochs=4")
    assert r.code == 0 and "resuming with max_epochs: 3 -> 4" in r.err and "warning" not in r.err
    r = jobrun("resume", "--run-dir", run, "--epoch", "2", "vars.step=5")
    assert r.code == 0, r.text
    assert "resuming with epoch.0.do.0.add.in.1: 1 -> 5" in r.err  # where the var is used
    assert "no longer the one an uninterrupted run would give" in r.err


def test_resume_says_when_a_change_leaves_training_as_it_was(tmp_path):
    """A change to the exit group (where the model is saved) does not change what trains:
    no warning that the result is another. A var no key uses any more (an earlier
    override replaced it) changes nothing, and the resume says so."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("max_epochs: 2", 'vars: {epochs: 2}\nmax_epochs: "${epochs}"')
                    + "exit:\n  - task: save\n    do: [{save: {in: [total], path: total.json}}]\n")
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run, "max_epochs=3").code == 0
    r = jobrun("resume", "--run-dir", run, "--epoch", "2", "exit.save.save.path=again.json")
    assert r.code == 0 and 'resuming with exit.0.do.0.save.path: "total.json" -> "again.json"' in r.err
    assert "warning" not in r.err and (run / "again.json").exists(), r.text
    r = jobrun("resume", "--run-dir", run, "vars.epochs=6")
    assert r.code == 0 and "note: no key of the plan uses the changed var(s) now" in r.err, r.text


def test_resume_with_other_changes_warns_and_records_them(trained):
    plan, run = trained
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "--set", "seed=7")
    assert r.code == 0, r.text
    assert "resuming with seed: (not set) -> 7" in r.err  # the plan left it to its default
    assert "no longer the one an uninterrupted run would give" in r.err


def test_resume_from_an_older_epoch_says_which_epochs_it_trains_again(trained):
    plan, run = trained
    r = jobrun("resume", "--run-dir", run, "--epoch", "0")
    assert r.code == 0, r.text
    assert ("note: going on from epoch 0 of a run saved up to epoch 2: epochs 1-2 are trained again; "
            "the checkpoints after epoch 0 are removed once it is restored") in r.err
    assert "removed the checkpoints of epochs 1-2, which this resume trains again" in r.out
    r = jobrun("resume", "--run-dir", run, "--epoch", "1", "max_epochs=3")
    assert r.code == 0 and "epoch 2 is trained again" in r.err, r.text
    r = jobrun("resume", "--run-dir", run, "max_epochs=4")  # from the newest: nothing again
    assert r.code == 0 and "trained again" not in r.err, r.text


def test_resume_from_an_epoch_kept_as_the_best_counts_the_pruned_epochs_it_trains_again(tmp_path):
    """keep: 2 pruned epoch 2, the best (1) and 3-4 stay: going on from 1 trains 2-4 again."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("max_epochs: 2", "max_epochs: 4").replace(
        "{dir: ckpt}", "{dir: ckpt, keep: 2, best: {monitor: total, mode: min}}"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    r = jobrun("resume", "--run-dir", run, "--epoch", "best")
    assert r.code == 0, r.text
    assert "note: going on from epoch 1 of a run saved up to epoch 4: epochs 2-4 are trained again" \
        in r.err, r.text
    assert "removed the checkpoints of epochs 3-4, which this resume trains again" in r.out


def test_resume_says_that_an_edited_plan_file_is_not_used(trained):
    plan, run = trained
    plan.write_text(PLAN.replace("max_epochs: 2", "max_epochs: 9"))
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 0, r.text
    assert f"{plan} changed since the run started" in r.err and "KEY=VALUE" in r.err
    assert "epoch 2/2" in r.out  # the stored plan
    plan.unlink()  # moved away: it did not change, it is gone
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 0 and f"warning: {plan} is gone; resume uses the plan stored in" in r.err, r.text


def test_positional_overrides_mean_set(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    r = jobrun("train", plan, "--run-dir", tmp_path / "run", "max_epochs=1")
    assert r.code == 0, r.text
    assert "epoch 1/1" in r.out
    r = jobrun("train", plan, "--run-dir", tmp_path / "run2", "oops")
    assert r.code == 2 and "overrides are KEY=VALUE" in r.err


# -- plan files that are not files ---------------------------------------------------------


def test_a_plan_from_dev_zero_is_refused_without_reading_it_all():
    r = jobrun("analyze", "/dev/zero")
    assert r.code == 2 and "more than the 67108864 bytes allowed" in r.err


def test_a_plan_from_a_pipe_is_read(tmp_path):
    import subprocess
    import sys

    text = (Path(__file__).resolve().parent.parent / "plans" / "counter.yaml").read_text()
    p = subprocess.run([sys.executable, "-m", "jobrun", "analyze", "/dev/stdin"], input=text,
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0 and "ok" in p.stderr
    big = subprocess.run([sys.executable, "-m", "jobrun", "analyze", "/dev/stdin"],
                         input="#" * (65 << 20), capture_output=True, text=True, timeout=HANG_S)
    assert big.returncode == 2 and "bytes allowed" in big.stderr


def test_a_checkpoint_dir_that_is_a_file_or_a_run_dir_too_long_is_refused_before_the_run(tmp_path):
    # The run trained to its end with every save failing ("check the disk"), exited 0 and
    # said "last checkpoint epoch 0"; a run directory's name too long gave a traceback.
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    (tmp_path / "afile").write_text("user's\n")
    for where in ("afile", "afile/under"):
        r = jobrun("train", plan, "--run-dir", tmp_path / "run", f"checkpoint.dir={tmp_path / where}")
        assert r.code == 2 and "Traceback" not in r.text, r.text
        assert f"checkpoint directory {tmp_path / where}" in r.err and "set checkpoint.dir" in r.err
    assert not (tmp_path / "run").exists() and (tmp_path / "afile").read_text() == "user's\n"
    r = jobrun("train", plan, "--run-dir", tmp_path / ("r" * 300))
    assert r.code == 2 and "File name too long" in r.err and "Traceback" not in r.text, r.text


def _unwritable_dirs_are_unwritable(tmp_path: Path) -> None:
    """Skip the test where this process writes into any directory (root with CAP_DAC_OVERRIDE)."""
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    try:
        (probe / "f").touch()
    except PermissionError:
        return
    finally:
        probe.chmod(0o755)
        shutil.rmtree(probe)
    pytest.skip("this process may write into a directory without write permission")


@pytest.mark.parametrize("what", ["local.2/rank-0", "local.2"])
def test_an_epoch_directory_made_unreadable_is_an_invalid_epoch_not_a_traceback(trained, what):
    # chmod 000 on a rank directory: ckpt list, show, verify, export and resume ended in
    # pathlib's PermissionError traceback (Path.exists raises it).
    plan, run = trained
    _unwritable_dirs_are_unwritable(run.parent)
    locked = run / "ckpt" / what
    before = _snapshot(run)
    locked.chmod(0)
    try:
        listed = jobrun("ckpt", "list", run)
        verified = jobrun("ckpt", "verify", run)
        shown = jobrun("ckpt", "show", run, "--blob", "total")
        resumed = jobrun("resume", run, "max_epochs=3")
    finally:
        locked.chmod(0o755)
    for r in (listed, verified, shown, resumed):
        _no_traceback(r)
    assert listed.code == 0 and f"INVALID: cannot read {locked}: Permission denied" in listed.out, listed.text
    assert verified.code == 1 and f"DAMAGED: cannot read {locked}: Permission denied" in verified.out
    assert shown.code == 0 and "epoch 1" in shown.out and "total = 1" in shown.out, shown.text
    assert resumed.code == 0 and "resumed from checkpoint epoch 1" in resumed.text, resumed.text
    after = _snapshot(run)
    assert all(after.get(k) == v for k, v in before.items() if k.startswith(f"ckpt/{what}")), "kept"


def test_runs_lists_a_run_directory_made_unreadable_as_damaged(trained, monkeypatch):
    # `jobrun runs` ended in pathlib's PermissionError traceback for one run it could not
    # look into, and listed none of the others.
    plan, run = trained
    _unwritable_dirs_are_unwritable(run.parent)
    other = run.parent / "other"
    shutil.copytree(run, other)
    monkeypatch.chdir(run.parent)
    run.chmod(0)
    try:
        r = jobrun("runs", ".")
    finally:
        run.chmod(0o755)
    _no_traceback(r)
    assert r.code == 0, r.text
    rows = {line.split()[0]: line.split()[2] for line in r.out.splitlines()[1:]}
    assert rows == {"run": "damaged", "other": "finished"}, r.out


def test_a_checkpoint_dir_outside_the_run_that_cannot_be_written_is_refused_before_train_or_resume(tmp_path):
    # A shared checkpoint.dir the user cannot write (another user's, or a read-only mount):
    # the run trained to its end with a warning at every save, then failed "no checkpoint
    # of it was saved".
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    _unwritable_dirs_are_unwritable(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o555)
    try:
        r = jobrun("train", plan, "--run-dir", tmp_path / "run", f"checkpoint.dir={shared / 'ckpt'}")
    finally:
        shared.chmod(0o755)
    assert r.code == 2 and "Traceback" not in r.text, r.text
    assert f"checkpoint directory {shared / 'ckpt'} cannot be written: {shared} is not writable" in r.err
    assert "set checkpoint.dir to a directory you can write" in r.err
    assert not (tmp_path / "run").exists() and list(shared.iterdir()) == []
    # A resume whose checkpoint directory became read-only since: the same, nothing changed.
    assert jobrun("train", plan, "--run-dir", tmp_path / "run", f"checkpoint.dir={shared / 'ckpt'}").code == 0
    before = _snapshot(tmp_path)
    (shared / "ckpt").chmod(0o555)
    try:
        r = jobrun("resume", tmp_path / "run", "max_epochs=4")
    finally:
        (shared / "ckpt").chmod(0o755)
    assert r.code == 2 and "Traceback" not in r.text, r.text
    assert f"checkpoint directory {shared / 'ckpt'} cannot be written: {shared / 'ckpt'} is not writable" in r.err
    assert _snapshot(tmp_path) == before
