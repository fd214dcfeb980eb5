"""A user's day with the commands: a run per experiment, one way to name a run, failing
fast (before torch is imported), and hints that name options the commands have."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from jobrun_test_helpers import mlp_plan
from runner_util import jobrun

from jobrun.cli import main

ROOT = Path(__file__).resolve().parent.parent

PLAN = """\
job: counter
max_epochs: 2
vars: {lr: 0.1}
checkpoint: {dir: ckpt, best: {monitor: total, mode: max}}
init:
  - task: setup
    do:
      - model.mlp: {out: model, sizes: [2, 2]}
      - optimizer: {in: model, out: opt, lr: "${lr}"}
      - const: {out: total, value: 0}
epoch:
  - task: count
    do:
      - add: {in: [total, 1], out: total}
      - log: {in: [total]}
    outputs: [total]
"""


@pytest.fixture
def here(tmp_path, monkeypatch):
    (tmp_path / "plan.yaml").write_text(PLAN)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- fail fast -------------------------------------------------------------------------------


def _train_without_torch(cwd: Path, *args: str, command: str = "train") -> tuple[int, str, bool]:
    """`jobrun train ARGS` in a fresh interpreter: exit code, stderr, whether torch was imported."""
    code = (
        "import sys\nfrom jobrun.cli import main\n"
        f"try:\n    main({[command, *args]!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "print('torch' in sys.modules, code)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    imported, exit_code = p.stdout.split()
    return int(exit_code), p.stderr, imported == "True"


def test_train_refuses_a_misspelt_op_before_importing_torch(here):
    (here / "bad.yaml").write_text(PLAN.replace("- add:", "- addd:"))
    code, err, imported = _train_without_torch(here, "bad.yaml")
    assert code == 2 and "bad.yaml:14:" in err and "unknown op 'addd'" in err and "did you mean 'add'" in err
    assert not imported
    assert not (here / "runs").exists()


def test_an_override_of_the_wrong_type_is_refused_before_torch(here):
    code, err, imported = _train_without_torch(here, "plan.yaml", "vars.lr=abc")
    assert code == 2 and not imported
    # refused at the var the override changes (a number in the plan), as a misspelt key is
    assert "plan.yaml:3:" in err and "vars.lr is a number in the plan (0.1), not the string 'abc'" in err
    assert not (here / "runs").exists()
    r = jobrun("analyze", "plan.yaml", "vars.lr=abc")
    assert r.code == 2 and "plan.yaml:3:" in r.err and "not the string 'abc'" in r.err
    r = jobrun("analyze", "plan.yaml", "++vars.lr=abc")  # set anyway: the optimizer's argument
    assert r.code == 1 and "plan.yaml:9:" in r.out and "expected a number" in r.out
    assert jobrun("analyze", "plan.yaml", "vars.lr=0.5").code == 0


def test_an_occupied_run_dir_is_refused_before_torch(here):
    assert jobrun("train", "plan.yaml", "--run-dir", "mine").code == 0
    code, err, imported = _train_without_torch(here, "plan.yaml", "--run-dir", "mine")
    assert code == 2 and not imported
    assert "already holds checkpoints" in err and "jobrun resume mine" in err
    # The hint once offered `jobrun train --overwrite`, a command without the plan (exit 2).
    assert "`jobrun train --overwrite`" not in err and "add --overwrite to this `jobrun train`" in err


def test_resume_refuses_a_bad_override_or_run_before_torch(here):
    assert jobrun("train", "plan.yaml").code == 0
    code, err, imported = _train_without_torch(here, "runs/counter/1", "vars.lr=abc", command="resume")
    assert code == 2 and not imported and "vars.lr is a number in the plan" in err
    code, err, imported = _train_without_torch(here, "runs/counter/9", command="resume")
    assert code == 2 and not imported and "there is no run in runs/counter/9" in err


def test_a_plan_given_before_its_command_is_pointed_at_train(here):
    code, err, imported = _train_without_torch(here, "max_epochs=3", command="plan.yaml")
    assert code == 2 and not imported and "Traceback" not in err
    assert "No such command 'plan.yaml': the command comes first, then the plan, e.g. " \
           "`jobrun train plan.yaml`" in err, err


def test_resume_given_the_plan_file_says_it_is_no_run_directory_and_how_to_train_it(here):
    code, err, imported = _train_without_torch(here, "plan.yaml", "max_epochs=3", command="resume")
    assert code == 2 and not imported and "Traceback" not in err
    assert "plan.yaml is a file, not a run directory" in err
    assert "to train this plan: `jobrun train plan.yaml`" in err


DATA_PLAN = """\
job: fromfile
max_epochs: 1
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - STEP
      - data.load: {out: [x, y], path: data/train.npz, keys: [x, y]}
      - reader: {in: [x, y], out: batches, batch_size: 4}
      - model.mlp: {out: model, sizes: [3, 2]}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: batches, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss}
"""

PREP = """\
from pathlib import Path

import numpy as np


def make(path="data/train.npz"):
    Path(path).parent.mkdir(exist_ok=True)
    np.savez(path, x=np.zeros((8, 3), "float32"), y=np.zeros(8, "int64"))
"""


def test_train_refuses_a_missing_data_file_before_torch_and_makes_no_directory(here):
    (here / "exp").mkdir()
    (here / "exp" / "plan.yaml").write_text(DATA_PLAN.replace("- STEP", "- const: {out: a, value: 1}"))
    code, err, imported = _train_without_torch(here, "exp/plan.yaml")
    assert code == 2 and not imported
    lines = err.splitlines()
    assert lines[0] == (f"exp/plan.yaml:8:40: error: data.load: 'data/train.npz' does not exist "
                        f"({here / 'exp' / 'data' / 'train.npz'})")
    assert lines[1] == (f"  hint: relative paths are read from the plan file's directory ({here / 'exp'}), "
                        "not from the current directory")
    assert not (here / "runs").exists()
    code, err, imported = _train_without_torch(here, "exp/plan.yaml", "--run-dir", "mine")
    assert code == 2 and not imported and not (here / "mine").exists()
    # The file beside the user, not beside the plan: the hint says so.
    (here / "prep.py").write_text(PREP)
    subprocess.run([sys.executable, "-c", "import prep; prep.make()"], cwd=here, check=True)
    code, err, imported = _train_without_torch(here, "exp/plan.yaml")
    assert code == 2 and not imported
    assert "data/train.npz is in the current directory: give its path from the plan's directory" in err
    # Where it belongs, the run goes; and a resume refuses it gone again, before torch.
    (here / "data").rename(here / "exp" / "data")
    assert jobrun("train", "exp/plan.yaml").code == 0
    (here / "exp" / "data" / "train.npz").unlink()
    code, err, imported = _train_without_torch(here, "runs/fromfile/1", "max_epochs=2", command="resume")
    assert code == 2 and not imported and "data.load: 'data/train.npz' does not exist" in err


@pytest.mark.parametrize("step", [
    'call: {fn: "prep:make", path: data/train.npz}',  # names the file it makes
    'call: {fn: "prep:make"}',  # makes it without saying: user code before the read
])
def test_a_data_file_an_earlier_step_makes_is_not_refused(here, step):
    (here / "prep.py").write_text(PREP)
    (here / "made.yaml").write_text(DATA_PLAN.replace("- STEP", "- " + step))
    r = jobrun("train", "made.yaml")
    assert r.code == 0, r.text
    assert (here / "data" / "train.npz").is_file()


# -- a run per experiment --------------------------------------------------------------------


def test_each_train_makes_a_new_run_and_commands_default_to_the_latest(here):
    first = jobrun("train", "plan.yaml")
    assert first.code == 0, first.text
    assert "run directory runs/counter/1" in first.err
    second = jobrun("train", "plan.yaml", "max_epochs=3")
    assert second.code == 0, second.text
    assert "run directory runs/counter/2" in second.err
    assert json.loads((here / "runs/counter/1/run.json").read_text())["last_epoch"] == 2

    listed = json.loads(jobrun("runs", "--json").out)
    assert [(r["path"], r["status"], r["epochs"], r["overrides"]) for r in listed] == [
        ("runs/counter/1", "finished", 2, []), ("runs/counter/2", "finished", 3, ["max_epochs=3"])]
    assert [(r["monitor"], r["best"], r["best_epoch"]) for r in listed] == [("total", 2, 2), ("total", 3, 3)]
    table = jobrun("runs").out
    assert "runs/counter/2" in table and "total=3 (epoch 3)" in table and "max_epochs=3" in table

    shown = jobrun("ckpt", "show", "--blob", "total", "--json")
    assert "run runs/counter/2 (the latest" in shown.err
    assert json.loads(shown.out)["epoch"] == 3  # --epoch latest is the default
    older = jobrun("ckpt", "show", "runs/counter/1", "--blob", "total", "--json")
    assert json.loads(older.out)["nodes"]["local"]["total"] == 2

    resumed = jobrun("resume", "runs/counter/1", "max_epochs=4")
    assert resumed.code == 0, resumed.text
    assert json.loads((here / "runs/counter/1/run.json").read_text())["last_epoch"] == 4
    again = jobrun("resume")  # the run resumed last is the latest now
    assert again.code == 0 and "run runs/counter/1 (the latest" in again.err and "already finished" in again.out


def test_runs_tells_a_killed_run_from_a_running_one_and_counts_its_epochs(here):
    # run.json says `running` from the start and records last_epoch when a run ends: a
    # kill -9 left "running, -" in the listing forever. The run's lock says whether a
    # process holds it; metrics.jsonl's epoch records say how far it got.
    import fcntl

    assert jobrun("train", "plan.yaml", "--run-dir", "runs/killed").code == 0
    info = json.loads((here / "runs/killed/run.json").read_text())
    info["status"] = "running"
    del info["last_epoch"], info["ended"]
    (here / "runs/killed/run.json").write_text(json.dumps(info))  # what a kill -9 leaves

    def listed() -> tuple[str, int]:
        (row,) = json.loads(jobrun("runs", "--json").out)
        return row["status"], row["epochs"]

    assert listed() == ("died", 2)
    with open(here / "runs/killed/.lock", "a") as lock:  # a process holds it: running
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert listed() == ("running", 2)
        info["status"], info["last_epoch"] = "finished", 2  # a resume still in its init
        (here / "runs/killed/run.json").write_text(json.dumps(info))
        assert listed() == ("running", 2)
    assert listed() == ("finished", 2)
    # a run.json that cannot be read: listed as damaged (it was left out), not the latest
    (here / "runs/other").mkdir()
    (here / "runs/other/run.json").write_text('{"replicas": "abc"}')
    rows = {r["path"]: r["status"] for r in json.loads(jobrun("runs", "--json").out)}
    assert rows == {"runs/other": "damaged", "runs/killed": "finished"}
    assert "runs/other" in jobrun("runs").out and "damaged" in jobrun("runs").out
    assert "run runs/killed (the latest" in jobrun("ckpt", "list").err


def test_runs_names_the_checkpoint_a_failed_run_resumes_from_when_it_is_older(here):
    # A run whose last save failed: EPOCHS said 2 (trained), as if epoch 2 could be
    # resumed from; `jobrun resume` goes on from epoch 1.
    assert jobrun("train", "plan.yaml", "--run-dir", "runs/failed").code == 0
    info = json.loads((here / "runs/failed/run.json").read_text())
    (here / "runs/failed/run.json").write_text(json.dumps({**info, "status": "failed"}))
    (here / "runs/failed/ckpt/local.2/rank-0/COMMIT").unlink()  # what a failed save leaves
    (row,) = json.loads(jobrun("runs", "--json").out)
    assert (row["status"], row["epochs"], row["last_checkpoint"]) == ("failed", 2, 1)
    assert re.search(r"failed +2 \(ckpt 1\) ", jobrun("runs").out), jobrun("runs").out
    assert "resumed from checkpoint epoch 1" in jobrun("resume").out


def test_a_run_of_the_old_layout_is_left_alone_and_listed(here):
    """runs/<job> itself a run (made before runs were numbered, or by --run-dir): new runs
    go beside it, never inside it, and the old one is found as the others are."""
    assert jobrun("train", "plan.yaml", "--run-dir", "runs/counter").code == 0
    r = jobrun("train", "plan.yaml")
    assert r.code == 0 and "run directory runs/counter-1" in r.err
    assert [x["path"] for x in json.loads(jobrun("runs", "--json").out)] == ["runs/counter", "runs/counter-1"]
    assert not list((here / "runs" / "counter").glob("[0-9]*"))


def test_runs_lists_the_runs_under_a_directory_or_the_run_it_is_given(here):
    """Runs trained with --run-dir outside ./runs were listed nowhere: `jobrun runs DIR`
    said "Got unexpected extra argument"."""
    assert jobrun("train", "plan.yaml", "--run-dir", "exp/a").code == 0
    assert jobrun("train", "plan.yaml", "max_epochs=3", "--run-dir", "exp/sweep/b").code == 0
    assert "jobrun runs DIR" in jobrun("runs").out  # nothing under ./runs: it says where else to look
    listed = json.loads(jobrun("runs", "exp", "--json").out)
    assert [(r["path"], r["status"], r["epochs"]) for r in listed] == [
        ("exp/a", "finished", 2), ("exp/sweep/b", "finished", 3)]
    assert "total=3 (epoch 3)" in jobrun("runs", "exp").out
    assert [r["path"] for r in json.loads(jobrun("runs", "exp/sweep/b", "--json").out)] == ["exp/sweep/b"]
    missing = jobrun("runs", "nope")
    assert missing.code == 2 and "'nope' does not exist" in missing.err


def test_run_dir_keeps_its_meaning(here):
    assert jobrun("train", "plan.yaml", "--run-dir", "mine").code == 0
    r = jobrun("train", "plan.yaml", "--run-dir", "mine")
    assert r.code == 2 and "already holds checkpoints" in r.err
    assert not (here / "runs").exists()


def test_resume_of_a_run_that_stopped_before_its_first_checkpoint_names_the_train_that_restarts_it(here):
    # It said "train again with `jobrun train`": no plan, no overrides, no run directory.
    (here / "plan.yaml").write_text(PLAN.replace(
        "      - const: {out: total, value: 0}",
        "      - const: {out: total, value: 0}\n      - data.load: {out: extra, path: later.npy}"))
    (here / "later.npy").write_bytes(b"not yet")  # init fails on it: before any checkpoint
    failed = jobrun("train", "plan.yaml", "max_epochs=3", "--run-dir", "runs/early")
    assert failed.code == 1 and "cannot read 'later.npy'" in failed.err
    r = jobrun("resume", "runs/early")  # nothing saved: it starts again, and meets the file again
    assert r.code == 1 and "it starts again from init" in r.err and "cannot read 'later.npy'" in r.err, r.text
    r = jobrun("resume", "runs/early", "max_epochs=4")  # with overrides it does not: it says how
    assert r.code == 2 and "no complete checkpoint" in r.err  # nothing to resume: bad input
    command = re.search(r"start it again with `([^`]+)`", r.err)
    assert command, r.err
    words = command.group(1).split()
    assert words[:2] == ["jobrun", "train"] and Path(words[2]) == here / "plan.yaml"
    assert words[3:] == ["max_epochs=3", "max_epochs=4", "--run-dir", "runs/early"]  # the run's, then these
    # --epoch 0 said only "no epoch in runs/early/ckpt is complete (`jobrun ckpt list` ...)"
    r = jobrun("resume", "runs/early", "--epoch", "0")
    assert r.code == 2 and "start it again with `jobrun train" in r.err and "max_epochs=4" not in r.err, r.text
    import numpy as np

    np.save(here / "later.npy", np.zeros(2, dtype=np.float32))
    again = jobrun(*words[1:])
    assert again.code == 0, again.text
    assert "epoch 4/4" in again.out and json.loads((here / "runs/early/run.json").read_text())["status"] == "finished"


def test_resume_of_a_run_whose_every_checkpoint_is_damaged_names_the_train_that_starts_it_anew(here):
    # It said "train again with `jobrun train`": which plan, with which overrides?
    assert jobrun("train", "plan.yaml", "max_epochs=2", "--run-dir", "runs/a").code == 0
    for commit in (here / "runs/a/ckpt").glob("local.*/rank-0/COMMIT"):
        commit.unlink()
    r = jobrun("resume", "runs/a", "max_epochs=3")
    assert r.code == 1 and "no complete checkpoint" in r.err and "Traceback" not in r.err, r.text
    command = re.search(r"train it again in a new run directory with `([^`]+)`", r.err)
    assert command, r.err
    words = command.group(1).split()
    assert words[:2] == ["jobrun", "train"] and Path(words[2]) == here / "plan.yaml"
    assert words[3:] == ["max_epochs=2", "max_epochs=3"]


def test_resume_that_moves_checkpoint_dir_says_the_checkpoints_are_where_it_was(here):
    # It said to train again from the start, though the run's checkpoints were intact.
    assert jobrun("train", "plan.yaml", "--run-dir", "runs/a").code == 0
    r = jobrun("resume", "runs/a", "checkpoint.dir=elsewhere", "max_epochs=3")
    assert r.code == 2 and "no complete checkpoint" in r.err  # bad input: an override and "Traceback" not in r.err, r.text
    assert ('this resume moves checkpoint.dir (checkpoint.dir: "ckpt" -> "elsewhere") and the run\'s '
            "checkpoints are not there: resume without that override") in r.err, r.err
    assert "jobrun train" not in r.err
    assert jobrun("resume", "runs/a", "max_epochs=3").code == 0


def test_a_resume_refused_for_another_checkpoint_dir_leaves_nothing_there(here, monkeypatch):
    # Its checkpoint lock was left there (with the directories made for it), outside the run.
    assert jobrun("train", "plan.yaml", "--run-dir", "runs/a").code == 0
    (here / "empty").mkdir()
    for elsewhere in (here / "new" / "deep", here / "empty"):
        r = jobrun("resume", "runs/a", f"checkpoint.dir={elsewhere}", "max_epochs=3")
        assert r.code == 2 and "no complete checkpoint" in r.err, r.text
    assert not (here / "new").exists() and list((here / "empty").iterdir()) == []

    # The lock file is removed as it is let go: a run that opened it just before still
    # gets a lock of its own, never the removed file's.
    from jobrun import safefs
    from jobrun.runner.locks import hold_dir_lock, hold_lock, holder

    lock, busy = here / "ck" / ".lock", RuntimeError
    with hold_dir_lock(lock, "first", busy):
        stale = [safefs.open_lock(lock)]
    assert not lock.parent.exists()
    lock.parent.mkdir()
    opened = safefs.open_lock
    monkeypatch.setattr(safefs, "open_lock", lambda path: stale.pop() if stale else opened(path))
    with hold_lock(lock, "second", busy):
        assert holder(lock) is None and lock.read_text() == "second"  # held by this process, at the path
        with pytest.raises(RuntimeError, match="second"), hold_lock(lock, "third", busy):
            pass


def test_ckpt_verify_finds_a_damaged_file(here):
    assert jobrun("train", "plan.yaml").code == 0
    assert jobrun("ckpt", "verify").code == 0
    data = sorted((here / "runs/counter/1/ckpt/local.1/rank-0").glob("*.bin")) \
        or sorted(p for p in (here / "runs/counter/1/ckpt/local.1/rank-0").rglob("*") if p.is_file()
                  and p.name not in ("COMMIT", "manifest.json", "meta.json"))
    blob = max(data, key=lambda p: p.stat().st_size)
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF
    blob.write_bytes(bytes(raw))
    r = jobrun("ckpt", "verify", "runs/counter/1", "--json")
    assert r.code == 1
    damaged = [(c["epoch"], c["valid"]) for c in json.loads(r.out)["checked"]]
    assert damaged == [(0, True), (1, False), (2, True)]
    assert jobrun("ckpt", "verify", "--epoch", "2").code == 0
    # An epoch some rank never saved (it failed first) is incomplete, not damaged
    from jobrun import store

    store.save({"total": 3}, {}, here / "runs/counter/1/ckpt", "local", 3, rank=0, world_size=2)
    r = jobrun("ckpt", "verify", "runs/counter/1", "--epoch", "3")
    assert r.code == 1 and "epoch 3 node local: INCOMPLETE: " in r.out and "rank 1" in r.out, r.text


def test_export_takes_the_latest_epoch_by_default(here):
    assert jobrun("train", "plan.yaml").code == 0
    r = jobrun("export", "--blob", "total", "-o", "t.json")
    assert r.code == 0, r.text
    assert json.loads((here / "t.json").read_text())["total"] == 2
    # The newest epoch incomplete (a kill during its save): the one before, and said so
    (here / "runs/counter/1/ckpt/local.2/rank-0/COMMIT").unlink()
    r = jobrun("export", "--blob", "total", "-o", "t.json")
    assert r.code == 0 and json.loads((here / "t.json").read_text())["total"] == 1
    assert "epoch 2 is not complete" in r.err and "the latest complete one is epoch 1" in r.err, r.err
    # a rank the run never had: asked for wrongly, not a checkpoint "that can be deleted"
    r = jobrun("ckpt", "show", "--rank", "5", "--blob", "total")
    assert r.code == 2 and "saved by 1 rank(s): there is no rank 5" in r.err and "deleted" not in r.err, r.err
    assert "hint: leave --rank out (rank 0)" in r.err, r.err


def test_no_runs_hint_names_real_commands(here):
    r = jobrun("ckpt", "list")
    assert r.code == 2 and "no runs under runs/" in r.err and "--run-dir" not in r.err
    assert "(e.g. `jobrun ckpt list path/to/run`)" in r.err  # the command run, not `jobrun resume`
    assert "(e.g. `jobrun plot path/to/run`)" in jobrun("plot").err


def test_analyze_and_print_take_json(here):
    a, b = jobrun("analyze", "plan.yaml", "--json"), jobrun("analyze", "plan.yaml", "--format", "json")
    assert a.code == b.code == 0 and json.loads(a.out) == json.loads(b.out)
    assert json.loads(jobrun("print", "plan.yaml", "--json").out) == json.loads(
        jobrun("print", "plan.yaml", "--format", "json").out)


# -- hints name options that exist -----------------------------------------------------------


def _commands() -> dict[str, set[str]]:
    """Every command path ("ckpt list") and the options it takes."""
    out: dict[str, set[str]] = {}

    def walk(cmd: click.Command, path: str) -> None:
        out[path] = {o for p in cmd.params for o in getattr(p, "opts", []) if o.startswith("-")}
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())

    walk(main, "")
    return out


def _strings() -> list[tuple[str, str]]:
    """(where, text) of every string constant and f-string in jobrun/."""
    found = []
    for path in sorted((ROOT / "jobrun").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.value))
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", text))
    return found


_COMMAND = re.compile(r"`jobrun ([a-z][a-z ]*?)((?: [^`]*)?)`")


def test_every_hint_names_options_its_command_has():
    commands = _commands()
    every = set().union(*commands.values())
    checked, wrong = 0, []
    for where, text in _strings():
        for m in _COMMAND.finditer(text):
            words = m.group(1).split()
            path = " ".join(words[:2]) if " ".join(words[:2]) in commands else words[0]
            if path not in commands:
                wrong.append(f"{where}: `jobrun {m.group(1)}` is no command")
                continue
            for opt in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", m.group(2)):
                checked += 1
                if opt not in commands[path]:
                    wrong.append(f"{where}: `jobrun {path}` has no option {opt}")
        for opt in re.findall(r"(?:give|use|with|or) (--[a-z][a-z-]+)", text):
            checked += 1
            if opt not in every:
                wrong.append(f"{where}: no command has {opt}")
    assert checked > 10
    assert not wrong, "\n".join(wrong)


# -- the epoch's mean loss -------------------------------------------------------------------

MEAN_PLAN = mlp_plan("mean", "seed: 0\nmax_epochs: 2", n=96, batch=16, lr=0.5,
                     step=["log: {in: [loss_last], msg: step}"], epoch=["log: {in: [loss, loss_last], msg: epoch}"],
                     outputs="[loss]")


def test_the_epoch_shows_the_mean_loss_of_its_steps(tmp_path, monkeypatch):
    from runner_util import logged

    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.yaml").write_text(MEAN_PLAN)
    assert jobrun("analyze", "plan.yaml").code == 0  # loss_last is known to analyze
    r = jobrun("train", "plan.yaml", "--run-dir", "run")
    assert r.code == 0, r.text
    steps, epochs = logged(tmp_path / "run", "step"), logged(tmp_path / "run", "epoch")
    assert len(steps) == 12 and len(epochs) == 2
    for e in (1, 2):
        values = [s["loss_last"] for s in steps if s["_epoch"] == e]
        end = next(x for x in epochs if x["_epoch"] == e)
        assert len(values) == 6 and len(set(values)) == 6
        assert end["loss"] == pytest.approx(sum(values) / 6, rel=1e-6)
        assert end["loss_last"] == values[-1]
        line = next(x for x in r.out.splitlines() if x.startswith(f"epoch {e}/2 "))
        assert float(re.search(r" loss=(\S+)", line).group(1)) == pytest.approx(end["loss"], rel=1e-3)
    outputs = [json.loads(line)["outputs"]["train"]["loss"] for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"event": "epoch"' in line]
    assert outputs == [pytest.approx(x["loss"], abs=1e-6) for x in epochs]


def test_monitoring_a_computed_value_says_to_add_it_to_the_outputs(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(MEAN_PLAN.replace("max_epochs: 2", "max_epochs: 2\nearly_stop: {monitor: loss_last}"))
    r = jobrun("analyze", plan)
    assert r.code == 1
    assert "early_stop monitors 'loss_last', which is not an output of any epoch task" in r.out
    assert "add 'loss_last' to the `outputs` of epoch task 'train', which computes it" in r.out
    assert "did you mean" not in r.out


# -- small things ----------------------------------------------------------------------------


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_files_jobrun_writes_follow_the_umask(tmp_path, umask, mode):
    from jobrun import safefs

    old = os.umask(umask)
    try:
        safefs.write_atomic(tmp_path / "a.json", b"{}")
        os.close(safefs.open_write(tmp_path / "b.log", append=True))
    finally:
        os.umask(old)
    assert [(tmp_path / n).stat().st_mode & 0o777 for n in ("a.json", "b.log")] == [mode, mode]


def test_new_copies_only_what_the_example_uses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert jobrun("new", "shapes", "--from", "cnn").code == 0
    files = sorted(str(p.relative_to(tmp_path / "shapes")) for p in (tmp_path / "shapes").rglob("*") if p.is_file())
    assert files == ["data/make_shapes.py", "data/shapes.npz", "plan.yaml"]
    text = (tmp_path / "shapes" / "plan.yaml").read_text()
    assert "plans/" not in text and "shapes/data/shapes.npz" in text
    assert jobrun("new", "lm", "--from", "charlm").code == 0
    files = sorted(str(p.relative_to(tmp_path / "lm")) for p in (tmp_path / "lm").rglob("*") if p.is_file())
    assert files == ["data/tiny.txt", "models/__init__.py", "models/charlm.py", "plan.yaml"]


@pytest.mark.parametrize("override,hint", [
    ("max_epoch=3", "did you mean 'max_epochs' or 'epoch'?"),
    ("checkpoint.kep=2", "did you mean 'checkpoint.keep'?"),
])
def test_override_hints_do_not_offer_to_add_a_misspelt_key(here, override, hint):
    """A key the plan format fixes is misspelt, never new: no `+KEY` in its hint."""
    r = jobrun("analyze", "plan.yaml", override)
    assert r.code == 2 and f"hint: {hint}" in r.err and "+" not in r.err.split("hint:")[1]
    added = jobrun("analyze", "plan.yaml", "vars.warmup=3")
    assert added.code == 2 and "write +vars.warmup=3" in added.err


def test_a_var_beside_a_near_miss_may_still_be_new(here):
    """vars are the user's own keys: the near miss comes first, adding it second."""
    r = jobrun("analyze", "plan.yaml", "vars.lrr=3")
    hint = r.err.split("hint:")[1]
    assert r.code == 2 and hint.index("did you mean 'vars.lr'?") < hint.index("write +vars.lrr=3")


def test_a_refused_train_leaves_signals_raising_not_exiting(here):
    """In one process (as the tests run commands) a refused train must not leave a signal
    handler that ends the process at once."""
    import signal

    from jobrun.errors import Interrupted

    (here / "bad.yaml").write_text(PLAN.replace("- add:", "- addd:"))
    from jobrun import signals

    assert jobrun("train", "bad.yaml").code == 2
    handler = signal.getsignal(signal.SIGTERM)
    assert handler is not signals._exit_now  # calling that one would end this process
    with pytest.raises(Interrupted):
        handler(signal.SIGTERM, None)


def test_trains_started_at_once_take_the_next_numbers(here):
    """A sweep launched in parallel (four `jobrun train` at once, no --run-dir): all but
    one failed with "another `jobrun train` made runs/counter/1 at the same moment"."""
    procs = [subprocess.Popen([sys.executable, "-m", "jobrun", "train", "plan.yaml", f"vars.lr={i}"],
                              cwd=here, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    said = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, said
    runs = sorted((here / "runs" / "counter").iterdir())
    assert [p.name for p in runs] == ["1", "2", "3", "4"]
    lrs = sorted(json.loads((p / "run.json").read_text())["sets"][0] for p in runs)
    assert lrs == [f"vars.lr={i}" for i in range(4)]  # each its own run


def test_a_number_taken_and_trained_before_the_check_is_passed_over(here, monkeypatch):
    """Another `train` may take the picked number and save checkpoints in it before this
    one checks the directory: that is the same race, not "already holds checkpoints"
    (CI met it with four trains at once on two cores)."""
    from jobrun.runner import launch

    picked = launch.new_run_path

    def taken_meanwhile(job):
        path = picked(job)
        if path.name == "1":  # the other train takes 1 and saves its first epoch
            assert jobrun("train", "plan.yaml", "--run-dir", str(path)).code == 0
        return path

    monkeypatch.setattr(launch, "new_run_path", taken_meanwhile)
    r = jobrun("train", "plan.yaml")
    assert r.code == 0, r.err
    assert "run directory runs/counter/2" in r.err
    assert sorted(p.name for p in (here / "runs" / "counter").iterdir()) == ["1", "2"]


def test_export_to_safetensors_keeps_a_0d_tensor_0d(tmp_path):
    """BatchNorm's num_batches_tracked came out of `export -o X.safetensors` with shape [1]:
    load_state_dict took it only through a compatibility shim of torch's, and
    torch.equal against the module's state_dict failed."""
    import torch
    from safetensors.torch import load_file

    (tmp_path / "plan.yaml").write_text(
        "job: bn\nmax_epochs: 1\ncheckpoint: {dir: ckpt, include: [model]}\n"
        "init:\n  - task: setup\n    do:\n"
        "      - build: {out: model, target: \"torch.nn:BatchNorm1d\", num_features: 3}\n"
        "epoch:\n  - task: t\n    do: [{const: {out: k, value: 1}}]\n")
    run = tmp_path / "run"
    assert jobrun("train", tmp_path / "plan.yaml", "--run-dir", run).code == 0
    r = jobrun("export", run, "--blob", "model", "-o", tmp_path / "m.safetensors")
    assert r.code == 0, r.text
    got = load_file(tmp_path / "m.safetensors")
    want = torch.nn.BatchNorm1d(3).state_dict()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert got["num_batches_tracked"].shape == torch.Size([])


def test_every_bundled_example_is_listed_with_a_whole_sentence():
    """`jobrun new --list` shows each example's first comment line: gpt's stopped mid-sentence."""
    from jobrun.scaffold import examples

    about = examples()
    assert {"mlp", "gpt", "cnn"} <= set(about)
    assert all(text.endswith(".") for text in about.values()), about


@pytest.mark.parametrize("override, said", [
    ("+init.setup.optimizer.nesterov=false_", "optimizer: nesterov must be true or false, got 'false_'"),
    ("+init.setup.optimizer.class=Adam", "optimizer: Adam takes no argument 'momentum'"),
    ("+init.setup.optimizer.momentun=0.5", "optimizer: SGD takes no argument 'momentun'"),
    ("vars.lr=.inf", "optimizer: lr must be finite, got inf"),  # it trained to NaN, exit 0
    ("+init.setup.optimizer.fused=maybe", "optimizer: fused must be true or false, got 'maybe'"),  # bool | None
    ("+init.setup.optimizer.kind=adamw", "write `class: AdamW` instead of `kind`"),
])
def test_an_optimizer_key_its_class_would_refuse_or_misread_is_refused_before_the_run(tmp_path, override, said):
    """A key the class does not take failed in init, after the run directory was made; a
    flag given as a string was taken as true (`nesterov: "false"` turned Nesterov on)."""
    plan = Path(__file__).resolve().parent.parent / "plans" / "mlp.yaml"
    r = jobrun("train", plan, "--run-dir", tmp_path / "run", "max_epochs=1", override)
    assert r.code == 2 and said in r.err and "Traceback" not in r.err, r.text
    assert not (tmp_path / "run").exists()
    if "momentun" in override:
        assert "did you mean 'momentum'?" in r.err


@pytest.mark.parametrize("rule, said, hint", [
    ("{names: [fc.*], learning_rate: 0.01}", "groups[1]: 'learning_rate' is neither a selector nor an option of AdamW",
     "did you mean 'lr'?"),
    ("{names: [fc.*], weight_decy: 0.0}", "groups[1]: 'weight_decy' is neither", "did you mean 'weight_decay'?"),
    # the options a rule may set are the constructor's, less `params`, which a rule cannot set
    ("{names: [fc.*], params: []}", "groups[1]: 'params' is neither", "options of AdamW: amsgrad, betas, capturable,"),
    # a rule's values are checked as the optimizer's own keys' are: it trained with the flag on
    ('{names: [fc.*], amsgrad: "false"}', "groups[1]: amsgrad must be true or false, got 'false'",
     "write `amsgrad: true` or `amsgrad: false`, unquoted"),
    ('{names: [fc.*], fused: "no"}', "groups[1]: fused must be true or false, got 'no'", "unquoted"),
    ("{names: [fc.*], lr: .inf}", "groups[1]: lr must be finite, got inf", ""),
])
def test_a_groups_rule_option_the_optimizer_does_not_take_or_misreads_is_refused_before_the_run(
        tmp_path, rule, said, hint):
    """A misspelt option in a group rule (`learning_rate:`) failed only in init, after the
    run directory was made, while the optimizer's own keys were checked before the run;
    a flag given as a string (`amsgrad: "false"`) was taken as true."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "job: groups\nmax_epochs: 1\ninit:\n  - task: setup\n    do:\n"
        "      - model.mlp: {out: model, sizes: [2, 1]}\n"
        "      - optimizer:\n          in: model\n          out: opt\n          class: AdamW\n"
        f"          groups:\n            - {{ndim_below: 2, weight_decay: 0.0}}\n            - {rule}\n"
        "epoch:\n  - task: go\n    do: []\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    key = rule.split(", ")[1].split(":")[0]
    col = plan.read_text().splitlines()[12].index(key) + 1
    assert r.code == 2 and "Traceback" not in r.err, r.text
    assert f"{plan}:13:{col}: error: optimizer: {said}" in r.err and hint in r.err, r.err
    assert "params" not in r.err.split("hint:")[-1] and not (tmp_path / "run").exists()


def test_a_key_a_torch_scheduler_does_not_take_is_refused_before_the_run_with_a_did_you_mean(tmp_path):
    """StepLR's `step_sise` failed in init, after the run directory was made, with only
    "check the arguments given in the plan against its signature"."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "job: typo\nmax_epochs: 1\ninit:\n  - task: setup\n    do:\n"
        "      - model.mlp: {out: model, sizes: [2, 1]}\n"
        "      - optimizer: {in: model, out: opt, lr: 0.1}\n"
        "      - scheduler: {in: opt, out: sched, target: torch.optim.lr_scheduler.StepLR, step_sise: 2}\n"
        "epoch:\n  - task: go\n    do:\n      - scheduler.step: {in: sched}\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "Traceback" not in r.err, r.text
    assert f"{plan}:8:83: error: scheduler: StepLR takes no argument 'step_sise'" in r.err, r.err
    assert "did you mean 'step_size'?" in r.err and not (tmp_path / "run").exists()


TYPO_MODEL = """\
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, features: int, hidden: int = 8, act: nn.Module | None = None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), act or nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x)


def scaled(x, factor: float = 1.0):
    return x * factor
"""


@pytest.mark.parametrize("step, said, at, hint", [
    ("{build: {out: model, target: typo_net_model.Net, features: 2, hiden: 4}}",
     "build: Net takes no argument 'hiden'", "hiden: 4}}", "did you mean 'hidden'?"),
    ("{build: {out: model, target: typo_net_model.Net, features: 2, act: {target: torch.nn.LeakyReLU, "
     "negative_slop: 0.1}}}", "build: LeakyReLU takes no argument 'negative_slop'", "{target: torch",
     "did you mean 'negative_slope'?"),
    ("{call: {fn: \"typo_net_model:scaled\", in: [model], out: model, factr: 2}}",
     "call: scaled takes no argument 'factr'", "factr: 2}}", "did you mean 'factor'?"),
    # a key of the op's own, misspelt, is offered too: `mutate` gave only scaled's arguments
    ("{call: {fn: \"typo_net_model:scaled\", in: [model], out: model, mutate: [model]}}",
     "call: scaled takes no argument 'mutate'", "mutate: [model]}}", "did you mean 'mutates'?"),
    ("{build: {out: model, target: typo_net_model.Net, features: 2, fork_rgn: true}}",
     "build: Net takes no argument 'fork_rgn'", "fork_rgn: true}}", "did you mean 'fork_rng'?"),
])
def test_a_keyword_the_code_a_plan_calls_does_not_take_is_refused_before_the_run(tmp_path, step, said, at, hint):
    """`build`'s `hiden: 4` for `hidden` failed in init, after the run directory was made,
    with "check the arguments given in the plan against its signature"; so did a nested
    target's key and a `call`'s."""
    (tmp_path / "typo_net_model.py").write_text(TYPO_MODEL)
    good = ("{build: {out: model, target: typo_net_model.Net, features: 2, hidden: 4, "
            "act: {target: torch.nn.LeakyReLU, negative_slope: 0.1}}}")
    text = ("job: typo\nmax_epochs: 1\ninit:\n  - task: setup\n    do:\n"
            "      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}\n"
            f"      - {good}\n      - {{call: {{fn: \"typo_net_model:scaled\", in: [x], out: x, factor: 2}}}}\n"
            "      - optimizer: {in: model, out: opt, lr: 0.1}\n"
            "epoch:\n  - task: go\n    do:\n      - train.step: {in: [model, opt, x, y], out: loss, loss: mse}\n"
            "    outputs: [loss]\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    r = jobrun("train", plan, "--run-dir", tmp_path / "good")
    assert r.code == 0, r.text  # the keys the code takes
    plan.write_text(text.replace(good, step) if step.startswith("{build") else
                    text.replace("      - optimizer:", f"      - {step}\n      - optimizer:"))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    line = 7 if step.startswith("{build") else 9
    col = plan.read_text().splitlines()[line - 1].index(at) + 1  # the key (or the argument holding the nested one)
    assert r.code == 2 and "Traceback" not in r.err, r.text
    assert f"{plan}:{line}:{col}: error: {said}" in r.err and hint in r.err, r.err


@pytest.mark.parametrize("change, said", [
    ("beta: 0.5, ", "missing a required argument: 'beta'"),
    ("in: [x]", "too many positional arguments"),
])
def test_a_call_its_function_cannot_take_is_refused_before_the_run(tmp_path, change, said):
    """A `call` whose function has a required keyword the step leaves out (a VAE step's
    `kl_warmup`), or takes fewer inputs than `in` names, failed at its first run with
    "TypeError: step() missing 1 required keyword-only argument", after init ran and
    checkpoint 0 was saved. The context it asks for (`generator`, `step`) is the run's."""
    (tmp_path / "vae_step.py").write_text(
        "def step(x, *, beta, generator, step, scale=1.0):\n    return x * beta * scale\n")
    good = "{call: {fn: \"vae_step:step\", in: [x], out: x, beta: 0.5, scale: 2}}"
    text = ("job: vae\nmax_epochs: 1\ncheckpoint: {dir: ckpt}\ninit:\n  - task: setup\n    do:\n"
            "      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}\n"
            f"epoch:\n  - task: go\n    do:\n      - {good}\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    assert jobrun("train", plan, "--run-dir", tmp_path / "good").code == 0
    bad = good.replace(change, "") if change.startswith("beta") else good.replace("in: [x]", "in: [x, y]")
    plan.write_text(text.replace(good, bad))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "Traceback" not in r.err, r.text
    assert f"{plan}:11:10: error: call: step(x, *, beta, generator, step, scale=1.0) cannot take" in r.err, r.err
    assert said in r.err and not (tmp_path / "run").exists(), r.err


@pytest.mark.parametrize("change, said, at, name", [
    (("in: [width], ", ""), "missing a required argument: 'head'", "8:9", "Classifier(d, head, *, scale=1.0)"),
    (("in: [width]", "in: [width, width]"), "too many positional arguments", "8:9", "Classifier("),
    ((", out_features: 3", ""), "missing a required argument: 'out_features'", "10:19", "Linear("),
])
def test_a_build_its_target_cannot_take_is_refused_before_the_run(tmp_path, change, said, at, name):
    """A `build` of a class missing a required constructor argument (a classifier built
    without `classes`) failed in init, after the run directory was made. Its inputs, then
    `args`, are the positional arguments; a nested target's `in` mapping gives keywords."""
    (tmp_path / "bind_net.py").write_text(  # its own name: the tests share sys.modules
        "import torch\n\n\nclass Classifier(torch.nn.Module):\n"
        "    def __init__(self, d, head, *, scale=1.0):\n"
        "        super().__init__()\n        self.body, self.head = torch.nn.Linear(d, d), head\n")
    good = ("      - build:\n          {in: [width], out: model, target: \"bind_net:Classifier\", scale: 2.0,\n"
            "           args: [{target: torch.nn.Linear, in: {in_features: width}, out_features: 3}]}\n")
    text = ("job: ft\nmax_epochs: 1\ncheckpoint: {dir: ckpt}\ninit:\n  - task: setup\n    do:\n"
            "      - const: {out: width, value: 4}\n" + good +
            "epoch:\n  - task: go\n    do:\n      - call: {fn: 'builtins:repr', in: [model], out: text}\n"
            "      - log: {in: [text]}\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    assert jobrun("train", plan, "--run-dir", tmp_path / "good").code == 0
    plan.write_text(text.replace(good, good.replace(*change)))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "Traceback" not in r.err, r.text
    assert f"{plan}:{at}: error: build: {name}" in r.err and "cannot take what this step gives it" in r.err, r.err
    assert said in r.err and not (tmp_path / "run").exists(), r.err


def test_a_misspelt_key_whose_value_an_override_gave_is_not_blamed_on_the_override(tmp_path):
    """OneCycleLR's `total_step: "${steps}"` run with `vars.steps=8` was refused at the
    value, with the hint "did you mean 'total_steps'? The value here came from
    `vars.steps=8` on the command line": the key is wrong, not the value. The error points
    at the key, without the note; so does analyze's for an op's own argument."""
    text = (
        "job: typo\nmax_epochs: 1\nvars: {steps: 4, batch: 2}\ninit:\n  - task: setup\n    do:\n"
        "      - data.synthetic: {out: [x, y], task: classification, n: 8, features: 2, classes: 2}\n"
        "      - reader: {in: [x, y], out: data, batch_size: \"${batch}\"}\n"
        "      - model.mlp: {out: model, sizes: [2, 2]}\n"
        "      - optimizer: {in: model, out: opt, lr: 0.1}\n"
        "      - scheduler: {in: opt, out: sched, target: torch.optim.lr_scheduler.OneCycleLR, max_lr: 0.1,\n"
        "                    total_step: \"${steps}\"}\n"
        "epoch:\n  - task: go\n    do:\n      - scheduler.step: {in: sched}\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text.replace("batch_size", "batch_sise"))
    r = jobrun("analyze", plan, "--set", "vars.batch=4")
    assert f"{plan}:8:41: error: `reader` has no argument `batch_sise`" in r.text, r.text
    assert "did you mean 'batch_size'?" in r.text and "command line" not in r.text, r.text
    plan.write_text(text)
    r = jobrun("train", plan, "--run-dir", tmp_path / "run", "vars.steps=8")
    assert r.code == 2 and "Traceback" not in r.err, r.text
    assert f"{plan}:12:21: error: scheduler: OneCycleLR takes no argument 'total_step'" in r.err, r.err
    assert "did you mean 'total_steps'?" in r.err and "command line" not in r.err, r.err
    assert not (tmp_path / "run").exists()


DECORATED = """\
import functools


def with_scale(f):
    @functools.wraps(f)
    def inner(x, scale=1.0):
        return f(x) * scale
    return inner


def quiet(f):  # takes options of its own from **kwargs, which no signature names
    @functools.wraps(f)
    def inner(*args, **kwargs):
        kwargs.pop("verbose", None)
        return f(*args, **kwargs)
    return inner


@with_scale
def double(x):
    return x * 2


@quiet
def triple(x):
    return x * 3
"""


def test_a_keyword_a_decorator_takes_beside_the_code_it_wraps_is_not_refused(tmp_path):
    """inspect.signature follows functools.wraps to the wrapped code: `scale`, which the
    wrapper takes, was refused before the run ('double takes no argument'), though the
    call ran; a key neither takes still is. A wrapper with **kwargs may take any key
    (`verbose`), so it is left to the run."""
    (tmp_path / "deco_code.py").write_text(DECORATED)
    text = ("job: deco\nmax_epochs: 1\ninit:\n  - task: setup\n    do:\n"
            "      - const: {out: x, value: 2.0}\n"
            "      - call: {fn: \"deco_code:double\", in: [x], out: z, scale: 3.0}\n"
            "      - call: {fn: \"deco_code:triple\", in: [x], out: t, verbose: true}\n"
            "epoch:\n  - task: go\n    do:\n      - log: {in: [z, t]}\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0 and "z=12" in r.out and "t=6" in r.out, r.text
    plan.write_text(text.replace("scale:", "scal:"))
    r = jobrun("train", plan, "--run-dir", tmp_path / "typo")
    assert r.code == 2 and "call: double takes no argument 'scal'" in r.err, r.text
    assert "did you mean 'scale'?" in r.err and not (tmp_path / "typo").exists()


@pytest.mark.parametrize("name, value", [("JOBRUN_PROGRESS_SECONDS", "abc"), ("JOBRUN_PROGRESS_SECONDS", "nan"),
                                         ("JOBRUN_DIST_TIMEOUT", "-1")])
def test_a_bad_seconds_setting_in_the_environment_is_one_message_before_anything_is_written(
        here, monkeypatch, name, value):
    """`abc` was a traceback at import (and a dead run directory), `nan` turned the
    progress lines off without a word."""
    monkeypatch.setenv(name, value)
    for args in (["train", "plan.yaml", "--run-dir", "runs/env"], ["ckpt", "list", "runs/env"]):
        r = jobrun(*args)
        assert r.code == 2 and f"error: {name}={value!r}: a number of seconds > 0 expected" in r.err, r.text
        assert "Traceback" not in r.text
    assert not (here / "runs" / "env").exists()


@pytest.mark.parametrize("command", [["train", "plan.yaml"], ["print", "plan.yaml"], ["analyze", "plan.yaml"],
                                     ["resume"]])
def test_a_set_without_its_value_names_the_option_it_took(here, command):
    """`--set --run-dir runs/b` said "unexpected argument 'runs/b'": --set had taken the
    option after it as its value."""
    r = jobrun(*command, "--set", "--run-dir", "runs/b")
    assert r.code == 2 and "--set has no KEY=VALUE (it took '--run-dir'" in r.err, r.err
    assert "write --set KEY=VALUE" in r.err and not (here / "runs").exists()
