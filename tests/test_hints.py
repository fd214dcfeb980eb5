"""Hints that suggest a command acting on a run, pasted as they are: they act on the run the
user named, also when it is not the latest one (a bare command would pick the latest),
with the overrides and options the user gave where the command repeats them."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from runner_util import data_plan, jobrun, write_data

from jobrun import hints

PLAN = data_plan(keep=10)


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    """runs/a (3 epochs), then runs/b (1 epoch): b is the latest run."""
    monkeypatch.chdir(tmp_path)
    write_data(tmp_path / "data.npz")
    (tmp_path / "plan.yaml").write_text(PLAN)
    assert jobrun("train", "plan.yaml", "--run-dir", "runs/a").code == 0
    assert jobrun("train", "plan.yaml", "--run-dir", "runs/b", "max_epochs=1").code == 0
    return tmp_path


def _hinted(text: str) -> list[str]:
    """The one `jobrun ...` command the hint line of ``text`` suggests, as shell words."""
    hint = next(line for line in text.splitlines() if line.strip().startswith("hint:"))
    found = [c for c in re.findall(r"`([^`]*)`", hint) if c.startswith("jobrun ")]
    assert len(found) == 1, hint
    words = shlex.split(found[0])
    return words[1:]


def _epochs_listed(out: str) -> list[int]:
    return [int(line.split()[0]) for line in out.splitlines() if re.match(r"\s+\d+\s", line)]


def _info(run) -> dict:
    return json.loads((run / "run.json").read_text())


def test_resume_refused_for_changed_data_hints_the_same_resume_of_that_run_with_force(two_runs):
    write_data(two_runs / "data.npz", scale=2.0)
    r = jobrun("resume", "runs/a", "max_epochs=4")
    assert r.code == 1 and "init built other things than when the run started" in r.err, r.text
    words = _hinted(r.err)
    assert words == ["resume", "runs/a", "max_epochs=4", "--force"]  # not the latest run's
    r = jobrun(*words)
    assert r.code == 0, r.text
    assert _info(two_runs / "runs/a")["last_epoch"] == 4
    assert _info(two_runs / "runs/b")["last_epoch"] == 1


def test_ckpt_verify_of_an_epoch_not_saved_lists_those_present_and_names_the_run(two_runs):
    r = jobrun("ckpt", "verify", "runs/a", "--epoch", "7")
    assert r.code == 2, r.text
    assert "runs/a has no checkpoint of epoch 7" in r.err
    assert "epochs present: 0, 1, 2, 3 (`jobrun ckpt list runs/a` shows them)" in r.err
    listed = jobrun(*_hinted(r.err))
    assert listed.code == 0 and _epochs_listed(listed.out) == [0, 1, 2, 3], listed.text
    # The latest run needs no name: the bare command picks it.
    r = jobrun("ckpt", "verify", "runs/b", "--epoch", "7")
    assert r.code == 2 and "epochs present: 0, 1 (`jobrun ckpt list` shows them)" in r.err, r.text


def test_resume_from_an_epoch_not_saved_hints_the_list_of_that_run(two_runs):
    r = jobrun("resume", "runs/a", "--epoch", "9")
    assert r.code == 2, r.text
    assert "give one of the complete epochs: 0, 1, 2, 3" in r.err
    words = _hinted(r.err)
    assert words == ["ckpt", "list", "runs/a"]
    listed = jobrun(*words)
    assert listed.code == 0 and _epochs_listed(listed.out) == [0, 1, 2, 3], listed.text


def test_resume_with_overrides_of_a_run_stopped_before_its_first_checkpoint_is_bad_input(two_runs):
    """commands.md: nothing to resume is refused as bad input (2), as `--epoch 0` of the same
    run is; the hinted train starts it again with the overrides given."""
    (two_runs / "fail.yaml").write_text(PLAN.replace(
        "      - optimizer: {in: model, out: opt, lr: 0.1}\n",
        "      - optimizer: {in: model, out: opt, lr: 0.1}\n"
        '      - call: {fn: "jobrun_test_helpers:fail_once", path: "${run_dir}/../failed"}\n'))
    assert jobrun("train", "fail.yaml", "--run-dir", "runs/f").code == 1
    r = jobrun("resume", "runs/f", "max_epochs=2")
    assert r.code == 2 and "no complete checkpoint in runs/f/ckpt" in r.err, r.text
    assert jobrun("resume", "runs/f", "--epoch", "0").code == 2
    words = _hinted(r.err)
    assert words == ["train", str(two_runs / "fail.yaml"), "max_epochs=2", "--run-dir", "runs/f"]
    r = jobrun(*words)
    assert r.code == 0, r.text
    assert _info(two_runs / "runs/f")["last_epoch"] == 2


def test_a_resume_hint_replaces_the_option_it_changes_and_keeps_the_rest(tmp_path):
    hints.act_on(tmp_path / "elsewhere", [("vars.lr=0.5",), ("--epoch", "3"), ("--replicas", "2")])
    try:
        assert hints.resume_again("--epoch", "2") == \
            f"jobrun resume {tmp_path / 'elsewhere'} vars.lr=0.5 --replicas 2 --epoch 2"
        assert hints.command("ckpt list") == f"jobrun ckpt list {tmp_path / 'elsewhere'}"
        hints.act_on(tmp_path / "with space")
        assert hints.command("ckpt list") == f"jobrun ckpt list '{tmp_path / 'with space'}'"
    finally:
        hints.act_on(None)
