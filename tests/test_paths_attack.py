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

import pytest
from runner_util import jobrun
from test_run_dir_safety import PLAN as SAFETY_PLAN

# The counter plan of the run directory tests, its checkpoint.dir left to each test.
PLAN = SAFETY_PLAN.replace("{dir: ckpt}", "{dir: CKPT}")


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
    _decoys(run, "my_notes.txt", "figures/", "ckpt/local.1/extra.txt")
    (run / "tensorboard").mkdir(exist_ok=True)
    (run / "tensorboard" / "events.out.tfevents.1.old").write_text("jobrun's\n")
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "max_epochs=1")
    assert r.code == 0, r.text
    assert (run / "my_notes.txt").read_text() == "user's my_notes.txt\n"
    assert (run / "figures" / "mine.txt").exists() and (run / "figures" / "rank-0" / "notes.txt").exists()
    assert (run / "ckpt" / "local.1" / "extra.txt").read_text() == "user's ckpt/local.1/extra.txt\n"
    assert not (run / "tensorboard" / "events.out.tfevents.1.old").exists()  # jobrun's own
    assert "note: train --overwrite kept" in r.err
    for name in ("my_notes.txt", "figures/", "ckpt/local.1/extra.txt"):
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


# -- a checkpoint directory is locked by the run that writes it -----------------------------


def test_a_second_run_on_a_locked_checkpoint_dir_is_refused_naming_the_first(tmp_path):
    from jobrun.runner.rundir import RunDir

    shared = tmp_path / "shared"
    plan = _plan(tmp_path, str(shared))
    first = RunDir(tmp_path / "first")
    with first.lock_checkpoints(shared):  # the first run, still writing
        r = jobrun("train", plan, "--run-dir", tmp_path / "second")
    assert r.code == 2
    assert f"checkpoint directory {shared} is in use by run {first.path.resolve()}" in r.err
    assert "checkpoint.dir" in r.err
    _clean(r)
    assert not shared.exists()  # nothing of the second run's written; the first's lock, made for it, gone
    assert jobrun("train", plan, "--run-dir", tmp_path / "second").code == 0  # free again


# -- no hang on a FIFO where the run keeps its plan -----------------------------------------


@pytest.mark.parametrize("command", ["resume", "ckpt list"])
def test_a_fifo_at_the_runs_plan_copy_is_a_message_not_a_hang(tmp_path, command):
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    plan.write_text(plan.read_text() + "# edited\n")  # the run now reads its own copy
    (run / "plan.yaml").unlink()
    os.mkfifo(run / "plan.yaml")
    args = ["resume", "--run-dir", run] if command == "resume" else ["ckpt", "list", run]
    r = jobrun(*args)
    assert r.code == 2 and "FIFO" in r.err and "plan.yaml" in r.err
    _clean(r)


# -- every writer, attacked the same ways ---------------------------------------------------
#
# A writer: what it writes (relative to the test's tmp_path), the plan's extra lines, and
# the command that writes it once the run has trained. Each is attacked with a symlink to
# a decoy outside, a FIFO, and a user's file, planted at the target, at the temporary
# name writers used to use (`.NAME.tmp`), and beside it (a user's file in its directory).

SAVE = """\
exit:
  - task: out
    do: [{save: {in: [total], path: SAVED}}]
"""

WRITERS = {
    "run.json": ("run/run.json", "", ["resume", "--run-dir", "run", "--epoch", "1"]),
    "metrics.jsonl": ("run/metrics.jsonl", "", ["resume", "--run-dir", "run", "--epoch", "1"]),
    "tensorboard": ("run/tensorboard", "", ["resume", "--run-dir", "run", "--epoch", "1"]),
    "console.log": ("run/console.log", "", ["resume", "--run-dir", "run", "--epoch", "1"]),
    "plan copy": ("run/plan.yaml", "", ["resume", "--run-dir", "run", "max_epochs=3"]),
    "run lock": ("run/.lock", "", ["resume", "--run-dir", "run", "--epoch", "1"]),
    "checkpoint lock": ("shared/.lock", "shared", ["resume", "--run-dir", "run", "--epoch", "1"]),
    "checkpoint epoch": ("run/ckpt/local.3", "", ["resume", "--run-dir", "run", "max_epochs=3"]),
    "checkpoint rank": ("run/ckpt/local.3/rank-0", "", ["resume", "--run-dir", "run", "max_epochs=3"]),
    "upload": ("up/local/rank-0", "upload", ["resume", "--run-dir", "run", "max_epochs=3"]),
    "plot": ("run/metrics.png", "", ["plot", "run"]),
    "export json": ("out.json", "", ["export", "run", "--epoch", "1", "--blob", "total", "-o", "out.json"]),
    "export pt": ("out.pt", "", ["export", "run", "--epoch", "1", "--blob", "total", "-o", "out.pt"]),
    "save json": ("run/model.json", "save", ["resume", "--run-dir", "run", "max_epochs=3"]),
    "save pt": ("run/model.pt", "save", ["resume", "--run-dir", "run", "max_epochs=3"]),
}
REFUSALS = ("symlink", "FIFO", "not a regular file", "refusing", "not a directory", "jobrun did not write",
            "a link or a file")


@pytest.mark.parametrize("place", ["target", "tmp", "beside"])
@pytest.mark.parametrize("kind", ["symlink", "fifo", "user"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_no_writer_writes_through_what_was_planted(tmp_path, monkeypatch, writer, kind, place):
    target_rel, extra, command = WRITERS[writer]
    ckpt = str(tmp_path / "shared") if extra == "shared" else "ckpt"
    up = f", upload: {tmp_path / 'up'}" if extra == "upload" else ""
    plan = _plan(tmp_path, ckpt, extra=up)
    if extra == "save":
        plan.write_text(plan.read_text() + SAVE.replace("SAVED", Path(target_rel).name))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    decoys = _decoys(tmp_path / "decoys", "victim.txt", "victim_dir/")
    before = _snapshot(decoys)
    target = tmp_path / target_rel
    is_dir = writer in ("checkpoint epoch", "checkpoint rank", "upload", "tensorboard")
    spot = {"target": target, "tmp": target.with_name(f".{target.name}.tmp"),
            "beside": target.with_name("mine.txt")}[place]
    if place == "beside" or (kind == "user" and place == "tmp"):
        kind = "user"
    spot.parent.mkdir(parents=True, exist_ok=True)
    if spot.is_symlink() or spot.is_file():
        spot.unlink()
    elif spot.is_dir():
        import shutil

        shutil.rmtree(spot)
    if kind == "symlink":
        spot.symlink_to(decoys / ("victim_dir" if is_dir and place == "target" else "victim.txt"))
    elif kind == "fifo":
        os.mkfifo(spot)
    elif is_dir and place == "target":
        _decoys(spot.parent, f"{spot.name}/")  # a user's directory of that name
    else:
        spot.write_text("the user's own\n")
    users = {p: p.read_bytes() for p in [spot] if kind == "user" and spot.is_file()}
    users_dirs = {spot: _snapshot(spot)} if kind == "user" and spot.is_dir() else {}
    monkeypatch.chdir(tmp_path)
    r = jobrun(*command)
    _clean(r)
    assert _snapshot(decoys) == before  # nothing outside was written through
    if r.code != 0 or "failed" in r.text:  # one clear message, naming what was planted
        assert "error: " in r.text or "failed: " in r.text, r.text
        if kind != "user":
            assert any(word in r.text for word in REFUSALS), r.text
    if place != "target":  # a user's file beside, or at an old temporary name, stays as it was
        for p, data in users.items():
            assert p.read_bytes() == data
    for p, snap in users_dirs.items():  # a user's directory where jobrun writes one: kept
        assert {k: v for k, v in _snapshot(p).items() if k in snap} == snap


def test_overwrite_deletes_what_save_wrote_in_the_run_but_not_the_users_file_of_that_name(tmp_path):
    plan = _plan(tmp_path)
    plan.write_text(plan.read_text() + SAVE.replace("SAVED", "out/model.json"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    assert (run / "out" / "model.json").is_file()
    assert (run / ".jobrun-written").read_text() == "out/model.json\n"  # recorded once
    (run / "out" / "mine.json").write_text("user's\n")
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "exit=[]")
    assert r.code == 0, r.text
    assert not (run / "out" / "model.json").exists()  # the old run's, by its record
    assert (run / "out" / "mine.json").read_text() == "user's\n"
    assert "out/" in r.err  # kept (it holds the user's file), and said
    assert not (run / ".jobrun-written").exists()  # the new run saved nothing


def test_a_record_that_leaves_the_run_deletes_nothing(tmp_path):
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    decoys = _decoys(tmp_path / "decoys", "victim.txt")
    (run / "link").symlink_to(decoys)
    (run / ".jobrun-written").write_text(f"../decoys/victim.txt\n{decoys}/victim.txt\nlink/victim.txt\n")
    before = _snapshot(decoys)
    r = jobrun("train", plan, "--run-dir", run, "--overwrite")
    assert r.code == 0, r.text
    assert _snapshot(decoys) == before


# -- the one delete, used by the store: prune, clean, a save's old copy, upload -------------


def _saved(tmp_path: Path, epochs=range(3), ranks=(0,)) -> Path:
    from jobrun import store

    ckpt = tmp_path / "ckpt"
    for e in epochs:
        for r in ranks:
            store.save({"e": e}, {}, ckpt, "n", e, rank=r, world_size=len(ranks))
    return ckpt


def test_prune_keeps_a_users_file_and_never_follows_a_link_in_an_epoch(tmp_path):
    from jobrun import store

    ckpt = _saved(tmp_path)
    decoys = _decoys(tmp_path / "decoys", "victim.txt", "victim_dir/")
    before = _snapshot(decoys)
    (ckpt / "n.0" / "mine.txt").write_text("user's\n")
    (ckpt / "n.0" / "rank-0" / "values.json.bak").write_text("user's\n")
    (ckpt / "n.1" / "rank-7").symlink_to(decoys / "victim_dir")  # a link named like a rank
    os.mkfifo(ckpt / "n.1" / "rank-0" / ".COMMIT.tmp-1-deadbeef")
    assert store.prune(ckpt, 1, ["n"]) == [0]  # epoch 1 is incomplete (rank-7)
    store.delete_epochs(ckpt, ["n"], [1])  # what prune does with an epoch: incomplete here
    assert _snapshot(decoys) == before
    left = _snapshot(ckpt)
    assert sorted(k.split("/", 1)[1] for k in left if k.startswith(".deleting-n.0-") and "/" in k) == \
        ["mine.txt", "rank-0", "rank-0/values.json.bak"]  # the user's files, in the renamed epoch
    assert any(k.startswith(".deleting-n.1-") and k.endswith("rank-7") for k in left)
    assert store.list_checkpoints(ckpt)[-1].epoch == 2 and len(store.list_checkpoints(ckpt)) == 1


def test_clean_removes_leftovers_but_not_links_or_fifos_named_like_them(tmp_path):
    from jobrun import store

    ckpt = _saved(tmp_path)
    decoys = _decoys(tmp_path / "decoys", "victim.txt", "victim_dir/")
    before = _snapshot(decoys)
    dead = 2**22 + 12345
    (ckpt / ".deleting-n.0-0badf00d").symlink_to(decoys / "victim_dir")
    (ckpt / "n.1" / f".tmp-rank-0-{dead}-deadbeef").symlink_to(decoys / "victim_dir")
    os.mkfifo(ckpt / "n.2" / "rank-0" / f".COMMIT.tmp-{dead}-deadbeef")
    (ckpt / "n.2" / f".old-rank-3-{dead}-deadbeef").mkdir()
    (ckpt / "n.2" / f".old-rank-3-{dead}-deadbeef" / "tensors.safetensors").write_text("x")
    assert store.clean(ckpt) == []  # the .old- copy of a missing rank-3 is put back, not removed
    assert (ckpt / "n.2" / "rank-3" / "tensors.safetensors").exists()
    assert _snapshot(decoys) == before
    assert (ckpt / ".deleting-n.0-0badf00d").is_symlink()


def test_a_save_never_writes_through_a_linked_epoch_directory(tmp_path):
    from jobrun import store
    from jobrun.errors import CheckpointError

    decoys = _decoys(tmp_path / "decoys", "victim_dir/")
    before = _snapshot(decoys)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "n.0").symlink_to(decoys / "victim_dir")
    with pytest.raises(CheckpointError, match="symlink"):
        store.save({"e": 0}, {}, tmp_path / "ckpt", "n", 0)
    assert _snapshot(decoys) == before


def test_upload_by_fewer_ranks_drops_the_earlier_uploads_extra_rank_only(tmp_path):
    from jobrun import store
    from jobrun.errors import CheckpointError

    two = _saved(tmp_path / "a", epochs=[1], ranks=(0, 1))
    one = _saved(tmp_path / "b", epochs=[2])
    up = tmp_path / "up"
    store.upload(two, "n", 1, up)
    (up / "n" / "notes.txt").write_text("user's\n")
    store.upload(one, "n", 2, up)
    assert sorted(p.name for p in (up / "n").iterdir()) == ["notes.txt", "rank-0"]
    assert store.load_dir(up / "n" / "rank-0")[0]["e"] == 2
    (tmp_path / "up2").mkdir()
    (tmp_path / "up2" / "n").symlink_to(up / "n")
    with pytest.raises(CheckpointError, match="not a directory"):
        store.upload(one, "n", 2, tmp_path / "up2")


def test_open_under_refuses_a_link_below_the_root(tmp_path):
    from jobrun import safedel

    (tmp_path / "real").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        safedel.open_under(tmp_path / "run", "ckpt")
    with pytest.raises(OSError):
        safedel.open_under(tmp_path / "run", "../real")
    os.close(safedel.open_under(tmp_path / "run" / "ckpt"))  # the root as the user named it


@pytest.mark.slow
def test_two_processes_given_one_checkpoint_dir(tmp_path):
    import subprocess
    import sys
    import time

    shared = tmp_path / "shared"
    plan = _plan(tmp_path, str(shared))
    plan.write_text(plan.read_text().replace("      - log: {in: [total]}\n",
                                             "      - log: {in: [total]}\n"
                                             "      - call: {fn: \"jobrun_test_helpers:sleep\", in: [0.5]}\n")
                    .replace("max_epochs: 2", "max_epochs: 40"))
    first = tmp_path / "first"
    proc = subprocess.Popen([sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(first)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not list(shared.glob("local.1")):
            time.sleep(0.05)
        saved = _snapshot(shared)
        r = jobrun("train", plan, "--run-dir", tmp_path / "second", "--set", "max_epochs=1")
        assert r.code == 2
        assert f"checkpoint directory {shared} is in use by run {first.resolve()} (pid {proc.pid})" in r.err
        _clean(r)
        now = _snapshot(shared)
        assert {k: now.get(k) for k in saved if k.startswith("local.0")} == \
            {k: v for k, v in saved.items() if k.startswith("local.0")}  # its epochs untouched
        assert not (tmp_path / "second" / "metrics.jsonl").exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("suffix", ["json", "pt"])
def test_save_never_writes_through_a_linked_directory_in_the_run(tmp_path, suffix):
    plan = _plan(tmp_path)
    plan.write_text(plan.read_text() + SAVE.replace("SAVED", f"out/model.{suffix}"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    decoys = _decoys(tmp_path / "decoys", "victim_dir/")
    before = _snapshot(decoys)
    for p in (run / "out").iterdir():
        p.unlink()
    (run / "out").rmdir()
    (run / "out").symlink_to(decoys / "victim_dir")
    r = jobrun("resume", "--run-dir", run, "max_epochs=3")
    assert r.code != 0 and "refusing to write" in r.err and "symlink, not a directory" in r.err
    _clean(r)
    assert _snapshot(decoys) == before


def test_overwrite_of_a_run_whose_plan_does_not_load_deletes_nothing(tmp_path):
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    original = plan.read_text()
    plan.write_text(original + "# edited: the run now reads its own copy\n")
    (run / "plan.yaml").write_text("job: counter\nepoch: [oops\n")
    before = _snapshot(run)
    r = jobrun("train", plan, "--run-dir", run, "--overwrite")
    assert r.code == 2 and "cannot tell which checkpoints" in r.err and "plan does not load" in r.err
    _clean(r)
    assert _snapshot(run) == before


@pytest.mark.parametrize("command", [["schema", "-o"], ["new", "--from", "counter"]])
def test_schema_and_new_never_write_through_a_link(tmp_path, monkeypatch, command):
    decoys = _decoys(tmp_path / "decoys", "victim.txt", "victim_dir/")
    before = _snapshot(decoys)
    monkeypatch.chdir(tmp_path)
    if command[0] == "schema":
        (tmp_path / "s.json").symlink_to(decoys / "victim.txt")
        r = jobrun(*command, "s.json")
        assert r.code == 2 and "symlink" in r.err
    else:
        (tmp_path / "job").symlink_to(decoys / "victim_dir")
        r = jobrun(*command, "job")
        assert r.code == 2 and "exists already" in r.err
    _clean(r)
    assert _snapshot(decoys) == before


# -- a save or export over the run's own files ---------------------------------------------


@pytest.mark.parametrize("saved", ["run.json", "metrics.jsonl", "./plan.yaml", "ckpt/local.1/rank-0/COMMIT"])
def test_a_save_over_the_runs_own_files_is_refused_before_the_run(tmp_path, saved):
    # It once overwrote run.json (no command could read the run after) or a checkpoint's
    # file, and the run still exited 0.
    plan = _plan(tmp_path)
    plan.write_text(plan.read_text() + SAVE.replace("SAVED", saved))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "Traceback" not in r.text, r.text
    line = plan.read_text().splitlines().index(f"    do: [{{save: {{in: [total], path: {saved}}}}}]") + 1
    assert f"plan.yaml:{line}:" in r.err and f"save: path '{saved}' is" in r.err, r.err
    assert "writing it would leave the run unreadable" in r.err and "a name of its own" in r.err
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_export_over_the_runs_own_files_is_refused(tmp_path):
    run = tmp_path / "run"
    assert jobrun("train", _plan(tmp_path), "--run-dir", run).code == 0
    before = _snapshot(run)
    for target in (run / "run.json", run / "ckpt" / "local.1" / "rank-0" / "values.json"):
        r = jobrun("export", run, "--blob", "total", "-o", target)
        assert r.code == 2 and "which the run needs" in r.err and "Traceback" not in r.text, r.text
    assert _snapshot(run) == before
    assert jobrun("export", run, "--blob", "total", "-o", run / "total.json").code == 0  # a file of its own


def test_a_save_of_a_type_it_cannot_write_is_refused_before_the_run(tmp_path):
    plan = _plan(tmp_path)
    plan.write_text(plan.read_text() + SAVE.replace("SAVED", "model.yaml"))  # found after training, once
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "save: unknown file type '.yaml' for model.yaml" in r.err, r.text
    assert "use .json, .safetensors or .pt" in r.err and not (tmp_path / "run").exists()


def test_overwrite_deletes_the_profile_and_the_csv_loggers_rows_of_the_old_run(tmp_path):
    # They are jobrun's; --overwrite kept them ("what jobrun did not write") beside the new run.
    plan = _plan(tmp_path)
    plan.write_text(plan.read_text() + "loggers: [csv]\n")
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run, "--profile").code == 0
    old = {"profile.txt", "profile.json", "metrics.csv", "trackers.json"}
    assert old <= {p.name for p in run.iterdir()}
    (run / "mine.txt").write_text("user's\n")
    r = jobrun("train", plan, "--run-dir", run, "--overwrite", "--set", "loggers=[]")
    assert r.code == 0, r.text
    assert not old & {p.name for p in run.iterdir()} and (run / "mine.txt").exists()
    assert "kept what jobrun did not write in" in r.err and "mine.txt" in r.err and "profile" not in r.err
