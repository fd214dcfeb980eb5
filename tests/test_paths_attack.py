"""What jobrun deletes and writes, attacked: checkpoint-like names beside a run, files the
user added, planted links, FIFOs and a user's files at every path jobrun writes.

Every test keeps decoy files outside (and inside) the run and asserts that none of them
changed, and that the command either succeeds without touching them or says one clear
thing (no traceback).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from runner_util import jobrun

PLAN = """\
job: counter
max_epochs: 2
checkpoint: {dir: CKPT}
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


def _plan(tmp_path: Path, ckpt: str = "ckpt", name: str = "plan.yaml", extra: str = "") -> Path:
    plan = tmp_path / name
    plan.write_text(PLAN.replace("{dir: CKPT}", f"{{dir: {ckpt}{extra}}}"))
    return plan


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under root (links not followed): a file's digest, a link's target."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            key = str(p.relative_to(root))
            if p.is_symlink():
                out[key] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[key] = "dir"
            elif p.is_file():
                out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[key] = "special"
    return out


def _decoys(root: Path, *names: str) -> Path:
    """User files at ``names`` (a trailing '/': a directory holding a file) under root."""
    for name in names:
        p = root / name.rstrip("/")
        if name.endswith("/"):
            (p / "rank-0").mkdir(parents=True, exist_ok=True)
            (p / "mine.txt").write_text(f"user's {name}\n")
            (p / "rank-0" / "COMMIT").write_text("user's, not jobrun's\n")
            (p / "rank-0" / "notes.txt").write_text("user's\n")
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"user's {name}\n")
    return root


def _clean(r) -> None:
    assert "Traceback" not in r.text


def _epochs(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("local."))


# -- train --overwrite deletes what the old run wrote, nothing else -------------------------


def test_overwrite_with_the_parent_as_checkpoint_dir_keeps_its_siblings(tmp_path):
    proj = tmp_path / "proj"
    plan = _plan(tmp_path, "..")
    run = proj / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    # local.9 is user-shaped too: a rank-0 holding a COMMIT and files of the user's
    _decoys(proj, "exp.1/", "results.2024/", "paper.tex", "local.9/")
    before = {k: v for k, v in _snapshot(proj).items() if not k.startswith(("run", "local.0", "local.1", "local.2"))}
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "max_epochs=1")
    assert r.code == 0, r.text
    after = _snapshot(proj)
    assert {k: v for k, v in after.items() if k in before} == before
    # local.9 is user-shaped (a rank-0 with files of the user's): its content stays
    assert "local.9/mine.txt" in after and "local.9/rank-0/notes.txt" in after
    assert not (proj / "local.2").exists()  # the old run's epoch 2 went
    assert "local.9/" in r.err and "kept" in r.err


def test_overwrite_with_an_absolute_checkpoint_dir_keeps_the_users_directories(tmp_path):
    shared = tmp_path / "shared"
    plan = _plan(tmp_path, str(shared))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    _decoys(shared, "photos.2023/", "release.1/", "local.notes")
    decoys = {k: v for k, v in _snapshot(shared).items() if not k.startswith("local.")}
    decoys["local.notes"] = _snapshot(shared)["local.notes"]
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "max_epochs=1")
    assert r.code == 0, r.text
    after = _snapshot(shared)
    assert {k: after.get(k) for k in decoys} == decoys
    assert _epochs(shared) == ["local.0", "local.1", "local.notes"]


def test_overwrite_does_not_delete_through_a_symlinked_checkpoint_dir(tmp_path):
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    target = tmp_path / "target"
    (run / "ckpt").rename(target)  # a real checkpoint tree, jobrun-shaped, outside
    (run / "ckpt").symlink_to(target)
    _decoys(target, "local.7/")
    before = _snapshot(target)
    r = jobrun("train", plan, "--run-dir", run, "--overwrite")
    assert r.code == 2 and "symlink" in r.err and "checkpoint.dir" in r.err
    _clean(r)
    assert {k: v for k, v in _snapshot(target).items() if k != ".lock"} == before  # the run's lock there


def test_overwrite_keeps_files_the_user_added_and_says_so(tmp_path):
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    _decoys(run, "my_notes.txt", "figures/", "ckpt/local.1/rank-0/extra.txt")
    (run / "tensorboard").mkdir(exist_ok=True)
    (run / "tensorboard" / "events.out.tfevents.1.old").write_text("jobrun's\n")
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "max_epochs=1")
    assert r.code == 0, r.text
    assert (run / "my_notes.txt").read_text() == "user's my_notes.txt\n"
    assert (run / "figures" / "mine.txt").exists() and (run / "figures" / "rank-0" / "notes.txt").exists()
    # The new run's save of epoch 1 moved the old rank-0 aside: the user's file stays in it
    kept = list((run / "ckpt" / "local.1").glob("*/extra.txt"))
    assert len(kept) == 1 and kept[0].read_text() == "user's ckpt/local.1/rank-0/extra.txt\n"
    assert not (run / "tensorboard" / "events.out.tfevents.1.old").exists()  # jobrun's own
    assert "note: train --overwrite kept" in r.err
    for name in ("my_notes.txt", "figures/", "ckpt/local.1/rank-0/extra.txt"):
        assert name in r.err
    assert json.loads((run / "run.json").read_text())["sets"] == ["max_epochs=1"]
    # The new run's epoch 1 replaced the old one's files, not the user's one
    assert (run / "ckpt" / "local.1" / "rank-0" / "COMMIT").exists()
    assert not (run / "ckpt" / "local.2").exists()


def test_overwrite_of_the_runs_own_plan_keeps_it(tmp_path):
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    mine = run / "plan.yaml"
    mine.write_text("# my comments\n" + PLAN.replace("{dir: CKPT}", "{dir: ckpt}"))
    text = mine.read_text()
    r = jobrun("train", mine, "--run-dir", run, "--overwrite")
    assert r.code == 0, r.text
    _clean(r)
    assert mine.read_text() == text
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert jobrun("resume", "--run-dir", run, "max_epochs=3").code == 0


def test_overwrite_in_the_current_directory_keeps_the_plan(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    (run / "myplan.yaml").write_text(plan.read_text())
    monkeypatch.chdir(run)
    r = jobrun("train", "myplan.yaml", "--run-dir", ".", "--overwrite")
    assert r.code == 0, r.text
    assert (run / "myplan.yaml").read_text() == plan.read_text()


# -- checkpoint.upload writes into a directory, never empties it ---------------------------


def test_upload_into_an_existing_directory_keeps_the_users_files(tmp_path):
    up = _decoys(tmp_path / "up", "local/mine.txt", "local/sub/more.txt", "other.txt")
    before = _snapshot(up)
    plan = _plan(tmp_path, "ckpt", extra=f", upload: {up}")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    after = _snapshot(up)
    assert {k: after.get(k) for k in before} == before
    assert (up / "local" / "rank-0" / "COMMIT").is_file()
    from jobrun import store

    assert store.verify_dir(up / "local" / "rank-0") == []


def test_upload_refuses_a_rank_directory_holding_the_users_files(tmp_path):
    up = _decoys(tmp_path / "up", "local/rank-0/mine.txt")
    before = _snapshot(up)
    plan = _plan(tmp_path, "ckpt", extra=f", upload: {up}")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert "upload of node 'local' failed" in r.text and "jobrun did not write (mine.txt)" in r.text
    _clean(r)
    assert _snapshot(up) == before
