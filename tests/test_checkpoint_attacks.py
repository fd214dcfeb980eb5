"""Crafted checkpoints: files that are not files, manifests with odd fields. Each is an
invalid checkpoint (never a hang, never a traceback), and resume falls back past it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from runner_util import jobrun, jobrun_proc

PLAN = """\
job: small
max_epochs: 3
checkpoint: {dir: ckpt}
init:
  - task: setup
    do: [{const: {out: total, value: 0}}, {randn: {out: w, shape: [4]}}]
epoch:
  - task: count
    do:
      - add: {in: [total, 1], out: total}
      - randn: {out: noise, shape: [2]}          # draws from the node's generator
      - call: {fn: "random:random", out: u}     # and from Python's: both are saved
    outputs: [total]
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    plan = root / "plan.yaml"
    plan.write_text(PLAN)
    run = root / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    return run


@pytest.fixture
def run(trained, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _rank(run: Path, epoch: int) -> Path:
    return run / "ckpt" / f"local.{epoch}" / "rank-0"


def _reseal(rdir: Path, change) -> None:
    """Change the manifest and write a COMMIT that vouches for it (as an attacker can)."""
    m = json.loads((rdir / "MANIFEST.json").read_text())
    change(m)
    raw = json.dumps(m).encode()
    (rdir / "MANIFEST.json").write_bytes(raw)
    commit = json.loads((rdir / "COMMIT").read_text())
    commit["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (rdir / "COMMIT").write_text(json.dumps(commit))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["values.json", "tensors.safetensors", "MANIFEST.json", "COMMIT"])
def test_a_fifo_in_a_checkpoint_makes_it_invalid_and_never_hangs(run, name):
    target = _rank(run, 3) / name
    target.unlink()
    os.mkfifo(target)
    # In this process: a command that opened the FIFO would hang the test run (as its own
    # process would until HANG_S), and a traceback would be in its text.
    listed = jobrun("ckpt", "list", run, "--verify")
    assert listed.code == 0, listed.text
    row = next(line for line in listed.out.splitlines() if line.split()[0] == "3")
    assert "INVALID" in row and "regular file" in row
    shown = jobrun("ckpt", "show", run, "--epoch", "3")
    assert shown.code == 1 and "regular file" in shown.err and "Traceback" not in shown.text
    exported = jobrun("export", run, "--epoch", "3", "--blob", "w", "-o", run / "w.json")
    assert exported.code == 1 and "Traceback" not in exported.text
    resumed = jobrun("resume", "--run-dir", run, "--epoch", "3")
    assert resumed.code == 1 and "cannot be used" in resumed.err


@pytest.mark.slow
def test_resume_skips_an_epoch_with_a_fifo_to_the_one_before(run):
    info = json.loads((run / "run.json").read_text())
    info["status"] = "interrupted"
    (run / "run.json").write_text(json.dumps(info))
    (_rank(run, 3) / "values.json").unlink()
    os.mkfifo(_rank(run, 3) / "values.json")
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert "skipping checkpoint epoch 3" in r.text and "resumed from checkpoint epoch 2" in r.out


def test_a_symlinked_data_file_is_not_followed(run, tmp_path):
    rdir = _rank(run, 3)
    outside = tmp_path / "outside.json"
    outside.write_bytes((rdir / "values.json").read_bytes())
    (rdir / "values.json").unlink()
    (rdir / "values.json").symlink_to(outside)
    r = jobrun("ckpt", "list", run, "--verify")
    row = next(line for line in r.out.splitlines() if line.split()[0] == "3")
    assert "INVALID" in row and "regular file" in row


@pytest.mark.parametrize(("field", "value"), [
    ("created", 1e300), ("created", -5), ("created", "yesterday"), ("seconds", float("inf")),
    ("epoch", "3"), ("node", 7), ("world_size", 0), ("rank", -1),
])
def test_every_manifest_field_is_checked_in_list_and_verify(run, field, value):
    _reseal(_rank(run, 3), lambda m: m.__setitem__(field, value))
    for args in (("ckpt", "list", run), ("ckpt", "list", run, "--verify"), ("ckpt", "list", run, "--json")):
        r = jobrun(*args)
        assert r.code == 0, r.text
        assert "Traceback" not in r.text
        if "--json" in args:
            rows = json.loads(r.out)["checkpoints"]
            assert [row["valid"] for row in rows if row["epoch"] == 3] == [False]
        else:
            row = next(line for line in r.out.splitlines() if line.split()[0] == "3")
            assert "INVALID" in row


def test_a_huge_manifest_is_refused_without_reading_it_whole(run):
    rdir = _rank(run, 3)
    with open(rdir / "MANIFEST.json", "ab") as f:
        f.truncate(65 << 20)  # sparse: no disk used
    r = jobrun("ckpt", "list", run)
    row = next(line for line in r.out.splitlines() if line.split()[0] == "3")
    assert "INVALID" in row


def test_resume_and_prune_clean_what_killed_saves_left(run):
    """Leftovers of a save or prune killed mid-way (their writer's pid is gone) disappear;
    those of a running process (pid 1) and a rank's old copy whose new one never arrived
    are treated right."""
    from jobrun import store

    ckpt = run / "ckpt"
    dead = 2**22 + 12345  # above any pid_max: no such process
    (ckpt / "local.3" / f".tmp-rank-0-{dead}-deadbeef").mkdir()
    (ckpt / "local.3" / f".tmp-rank-0-{dead}-deadbeef" / "tensors.safetensors").write_bytes(b"x")
    (ckpt / ".deleting-local.1-0badf00d").mkdir()
    (_rank(run, 1) / ".COMMIT.tmp-12345678").write_text("{")
    (ckpt / "local.3" / ".tmp-rank-0-1-cafebabe").mkdir()  # pid 1 is alive: not ours to take
    # a rank moved aside for a rewrite that was then killed: the old copy comes back
    (_rank(run, 2)).rename(ckpt / "local.2" / f".old-rank-0-{dead}-feedface")
    removed = store.clean(ckpt)
    assert sorted(removed) == sorted([f"local.3/.tmp-rank-0-{dead}-deadbeef", ".deleting-local.1-0badf00d",
                                      "local.1/rank-0/.COMMIT.tmp-12345678"])
    assert (ckpt / "local.3" / ".tmp-rank-0-1-cafebabe").is_dir()
    assert (_rank(run, 2) / "COMMIT").is_file()
    assert jobrun("ckpt", "list", run, "--verify").out.count(" ok") == 4
    (ckpt / ".deleting-local.0-0badf00d").mkdir()
    r = jobrun("resume", "--run-dir", run, "--epoch", "2")
    assert r.code == 0, r.text
    assert not (ckpt / ".deleting-local.0-0badf00d").exists()


# -- a damaged random state, re-sealed so that the checksums pass -------------------------


def _reseal_file(rdir: Path, name: str) -> None:
    """Make MANIFEST.json and COMMIT vouch for the file as it is now."""
    from jobrun.store import tensorfile

    def change(m):
        info = m["files"][name]
        info["size"] = (rdir / name).stat().st_size
        info["crc32_chunks"] = tensorfile.checksum_file(rdir / name, info["chunk_bytes"])

    _reseal(rdir, change)


def _damage_python_state(rdir: Path) -> None:
    values = json.loads((rdir / "values.json").read_text())
    state = values["blobs"]["jobrun:rng"]
    python = next(v for k, v in _pairs(state) if k == "python")
    python["items"][1]["items"][-1] = 700  # the position in the state: 0..624
    (rdir / "values.json").write_text(json.dumps(values))
    _reseal_file(rdir, "values.json")


def _pairs(encoded: dict) -> list:
    if "__jobrun__" in encoded:  # a tagged dict: [key, value] pairs
        return [(k, v) for k, v in encoded["items"]]
    return list(encoded.items())


def _damage_generator_state(rdir: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(rdir / "tensors.safetensors")
    values = json.loads((rdir / "values.json").read_text())
    node = next(v for k, v in _pairs(values["blobs"]["jobrun:rng"]) if k == "node")
    tensors[node["key"]] = tensors[node["key"]].clone().zero_()  # an all-zero mt19937 state
    save_file(tensors, rdir / "tensors.safetensors")
    _reseal_file(rdir, "tensors.safetensors")


@pytest.mark.parametrize("damage", [_damage_python_state, _damage_generator_state],
                         ids=["python", "node generator"])
def test_a_damaged_random_state_is_an_invalid_checkpoint(run, damage):
    damage(_rank(run, 3))
    listed = jobrun("ckpt", "list", run)  # the cheap listing reads no data
    assert all(line.endswith("ok") for line in listed.out.splitlines()[1:])
    verified = jobrun("ckpt", "list", run, "--verify")
    row = next(line for line in verified.out.splitlines() if line.split()[0] == "3")
    assert "INVALID" in row and "random state" in row and "damaged" in row
    assert "Traceback" not in verified.text
    named = jobrun("resume", "--run-dir", run, "--epoch", "3")
    assert named.code == 1 and "cannot be used" in named.err and "random state" in named.err
    info = json.loads((run / "run.json").read_text())
    info["status"] = "interrupted"
    (run / "run.json").write_text(json.dumps(info))
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert "skipping checkpoint epoch 3" in r.text and "resumed from checkpoint epoch 2" in r.out


def test_ckpt_list_verify_in_its_own_process_finds_a_damaged_generator_state(run):
    _damage_generator_state(_rank(run, 3))
    r = jobrun_proc("ckpt", "list", run, "--verify")
    row = next(line for line in r.out.splitlines() if line.split()[0] == "3")
    assert "INVALID" in row and "Invalid mt19937 state" in row


def test_a_reader_state_out_of_range_names_the_epoch_and_blob_and_the_epoch_before(tmp_path):
    # A damaged (re-sealed) reader position: "reader state is out of range: {...}", with
    # no epoch, no blob and no way on.
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("do: [{const: {out: total, value: 0}}, {randn: {out: w, shape: [4]}}]",
                                 "do: [{const: {out: total, value: 0}}, {randn: {out: w, shape: [4]}},\n"
                                 "         {reader: {in: w, out: r, passes: 0}}]").replace(
        "      - add: {in: [total, 1], out: total}\n",
        "      - add: {in: [total, 1], out: total}\n      - read: {in: r, out: [x]}\n"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    rdir = _rank(run, 3)
    text = json.dumps(json.loads((rdir / "values.json").read_text()))
    assert '"position": 3' in text  # the reader's, after 3 reads
    (rdir / "values.json").write_text(text.replace('"position": 3', '"position": -5', 1))
    _reseal_file(rdir, "values.json")
    r = jobrun("resume", run, "max_epochs=4")
    assert r.code != 0 and "Traceback" not in r.text
    assert "checkpoint epoch 3, blob 'r' on node 'local': its saved state does not load: reader state is " \
           "out of range" in r.err, r.err
    assert f"`jobrun resume {run} max_epochs=4 --epoch 2`" in r.err  # the same resume, from epoch 2
    assert jobrun("resume", run, "--epoch", "2", "max_epochs=4").code == 0


def test_a_damaged_epoch_in_the_way_of_its_save_again_is_moved_aside_and_kept(run):
    # Resumed from the epoch before, the run saves this epoch again; the damaged files are
    # not jobrun's by its records, so they stay, moved aside (its save failed, before).
    (_rank(run, 3) / "MANIFEST.json").unlink()
    tensors = (_rank(run, 3) / "tensors.safetensors").read_bytes()
    r = jobrun("resume", run, "max_epochs=4")
    assert r.code == 0 and "resumed from checkpoint epoch 2" in r.out, r.text
    assert "NOT saved" not in r.err and "check the disk" not in r.err, r.err
    kept = list((run / "ckpt").glob(".deleting-local.3-*/rank-0"))
    assert [(p / "tensors.safetensors").read_bytes() for p in kept] == [tensors]
    assert f"{kept[0].parent.name}/rank-0/; look at it, then delete it" in r.err, r.err
    rows = jobrun("ckpt", "list", run, "--verify").out.splitlines()
    assert next(row for row in rows if row.split()[0] == "3").endswith("ok")  # saved again
