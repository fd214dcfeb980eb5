"""Checkpoint, kill, resume: the result equals an uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_util import HANG_S, ckpt_values, jobrun, logged

# Random draws, a shuffled reader and a model-free "training" loop: every kind of state
# the runner must restore (node generator, global RNGs, reader position, blobs).
PLAN = """
job: walk
seed: 3
max_epochs: 6
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - randn: {out: w, shape: [4]}
      - const: {out: data, value: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]}
      - reader: {in: data, out: r, batch_size: 2, shuffle: true, passes: 0}
      - const: {out: steps, value: 0}
epoch:
  - task: train
    do:
      - loop: 3
        do:
          - read: {in: r, out: [xb, end]}
          - if: end
            then: [{read: {in: r, out: [xb, end]}}]
          - randn: {out: noise, shape: [4], std: 0.1}
          - add: {in: [w, noise], out: w}
          - add: {in: [steps, 1], out: steps}
      - call: {fn: "jobrun_test_helpers:sleep", in: [0.15]}
      - log: {in: [steps, xb]}
    outputs: [steps]
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of PLAN, shared by the tests of this module (which copy it
    before they change anything)."""
    root = tmp_path_factory.mktemp("reference")
    plan = root / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]"))
    r = jobrun("train", plan, "--run-dir", root / "run")
    assert r.code == 0, r.text
    return root / "run"


def _final(run_dir: Path) -> dict:
    return ckpt_values(run_dir, 6)


def test_resume_from_every_epoch_is_bit_exact(reference, tmp_path):
    want = _final(reference)
    for epoch in range(6):
        run = tmp_path / f"from{epoch}"
        shutil.copytree(reference, run)
        r = jobrun("resume", "--run-dir", run, "--epoch", str(epoch))
        assert r.code == 0, r.text
        assert f"resumed from checkpoint epoch {epoch}" in r.out
        assert _final(run) == want, f"resume from epoch {epoch} diverged"
        # metrics.jsonl tells one consistent story: one log line per epoch
        assert [x["_epoch"] for x in logged(run)] == [1, 2, 3, 4, 5, 6]


def test_resume_finished_run_does_nothing(reference, tmp_path):
    run = tmp_path / "done"
    shutil.copytree(reference, run)
    before = sorted(p.name for p in (run / "ckpt").iterdir())
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0
    assert "already finished at epoch 6" in r.out
    assert f"train on with `jobrun resume {run} max_epochs=N`" in r.out  # the way to go on, as README says
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == before


def _start(plan: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _killed_then_resumed(plan: Path, run_dir: Path, delay: float):
    """`jobrun train` killed (SIGKILL) after `delay` seconds, then resumed; trained again
    instead when it was killed before checkpoint 0 or before the run directory was made.
    The last command's result."""
    proc = _start(plan, run_dir)
    time.sleep(delay)
    proc.kill()
    proc.wait()
    r = jobrun("resume", "--run-dir", run_dir)
    if r.code != 0 and any(why in r.err for why in (
            "no complete checkpoint", "there is no run", "not a jobrun run directory")):
        shutil.rmtree(run_dir, ignore_errors=True)
        r = jobrun("train", plan, "--run-dir", run_dir)
    return r


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.6, 1.4, 1.9, 2.4, 3.0])
def test_kill_9_then_resume_is_bit_exact(reference, tmp_path, delay):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "run"
    r = _killed_then_resumed(plan, run, delay)
    assert r.code == 0, r.text
    assert _final(run) == _final(reference)


# `jobrun train` whose process is killed (SIGKILL, no handler runs) as it is about to write
# the epoch record of epoch 2 to metrics.jsonl: what a kill -9 between the save of the
# epoch's checkpoint and its record leaves.
_KILLED_BEFORE_RECORD = """
import os, signal, sys
from jobrun.runner import records
write = records.Metrics.write
def killed(self, record):
    if record.get("event") == "epoch" and record.get("epoch") == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    write(self, record)
records.Metrics.write = killed
from jobrun.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_an_epoch_record_a_kill_9_lost_after_its_save_is_restored_by_the_resume(reference, tmp_path):
    # The resume went on from epoch 2, and metrics.jsonl (plot, the CSV tracker) never had
    # epoch 2's outputs.
    plan, run = tmp_path / "plan.yaml", tmp_path / "run"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]").replace("max_epochs: 6", "max_epochs: 6\nloggers: [csv]"))
    p = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_RECORD, "train", str(plan), "--run-dir", str(run)],
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert (run / "ckpt" / "local.2" / "rank-0" / "COMMIT").exists()
    before = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in before if m.get("event") == "epoch"] == [1]
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 2" in r.out
    assert _final(run) == _final(reference)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [m for m in records if m.get("event") == "epoch"]
    want = [m for m in map(json.loads, (reference / "metrics.jsonl").read_text().splitlines())
            if m.get("event") == "epoch"]
    assert [m["epoch"] for m in epochs] == [1, 2, 3, 4, 5, 6]
    assert [m["outputs"] for m in epochs] == [m["outputs"] for m in want]
    assert [m["step"] for m in epochs] == [m["step"] for m in want]
    assert [m.get("restored", False) for m in epochs] == [False, True, False, False, False, False]
    # metrics.csv too, at the step an uninterrupted run gives it (no optimizer: the epoch)
    rows = [row for row in (run / "metrics.csv").read_text().splitlines() if ",epoch/train/steps," in row]
    assert rows == [f"{e},{e},epoch/train/steps,{3.0 * e}" for e in range(1, 7)]


@pytest.mark.slow
def test_kill_9_during_saves(tmp_path, reference):
    """Kill at many moments while large checkpoints are being written."""
    big = PLAN.replace(
        "randn: {out: w, shape: [4]}",
        "randn: {out: w, shape: [4]}\n      - randn: {out: big, shape: [4000000]}",
    )
    plan = tmp_path / "plan.yaml"
    plan.write_text(big.replace("[0.15]", "[0.0]"))
    ref = tmp_path / "ref"
    assert jobrun("train", plan, "--run-dir", ref).code == 0
    want = ckpt_values(ref, 6)["w"]
    for i, delay in enumerate([1.2, 1.5, 1.8, 2.1]):
        run = tmp_path / f"run{i}"
        r = _killed_then_resumed(plan, run, delay)
        assert r.code == 0, r.text
        assert ckpt_values(run, 6)["w"] == want
        leftovers = [p for p in (run / "ckpt").rglob("*") if ".tmp" in p.name]
        assert not leftovers or all(p.exists() for p in leftovers)  # never taken for a checkpoint


@pytest.mark.slow
def test_with_replicas_a_closed_output_stops_the_run_as_sigpipe_would(tmp_path):
    """`jobrun train --replicas 2 | head -1` exited 1: "replica rank 0 failed (exit code
    141): To enable traceback see ...", for a run stopped as one process stops."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run),
                             "--replicas", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("epoch 1/6")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=HANG_S) == 128 + signal.SIGPIPE, err
    assert "stopped by SIGPIPE" in err and "failed" not in err and "Traceback" not in err, err
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    assert jobrun("resume", "--run-dir", run).code == 0


@pytest.mark.slow
def test_a_closed_output_stops_the_run_as_sigpipe_would_and_it_resumes(reference, tmp_path):
    # `jobrun train plan.yaml | head -1`: the next epoch line met a closed pipe, and the
    # run was recorded failed ("BrokenPipeError"), with nothing said on stderr.
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("epoch 1/6")
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read()
    assert proc.wait(timeout=HANG_S) == 128 + signal.SIGPIPE, err
    assert "stopped by SIGPIPE" in err and "jobrun resume" in err and "Traceback" not in err, err
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert _final(run) == _final(reference)


@pytest.mark.slow
def test_a_resume_stopped_before_its_restore_leaves_the_run_as_it_was(tmp_path):
    # A resume records itself (overrides, status, the metrics after its epoch dropped) only
    # once the checkpoint is restored: one stopped in init changes nothing of the run.
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("max_epochs: 6", "max_epochs: 2\nvars: {marker: none, pause: 0}").replace(
        "      - const: {out: steps, value: 0}\n",
        "      - const: {out: steps, value: 0}\n"
        "      - call: {fn: \"jobrun_test_helpers:touch\", path: \"${marker}\"}\n"
        "      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: \"${pause}\"}\n"))
    run, marker = tmp_path / "run", tmp_path / "in-init"
    assert jobrun("train", plan, "--run-dir", run, f"vars.marker={tmp_path / 'trained'}").code == 0
    kept = {name: (run / name).read_bytes() for name in ("run.json", "plan.yaml", "metrics.jsonl")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobrun", "resume", str(run), "--epoch", "1", "max_epochs=3",
         f"vars.marker={marker}", "vars.pause=60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + HANG_S
    while time.time() < deadline and not marker.exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert {name: (run / name).read_bytes() for name in kept} == kept
    r = jobrun("resume", "--run-dir", run)  # as if it had never been tried: finished at 2
    assert r.code == 0 and "already finished at epoch 2" in r.out, r.text


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 138)])
def test_signal_stops_cleanly_and_resumes(reference, tmp_path, sig, code):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "run"
    proc = _start(plan, run)
    deadline = time.time() + HANG_S
    while time.time() < deadline and not (run / "ckpt" / "local.1" / "rank-0" / "COMMIT").exists():
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == code, out
    assert f"stopped by {sig.name}" in out and "jobrun resume" in out
    assert "Traceback" not in out
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted"
    # last_epoch: the last epoch that ran to its end (not the one running), whose
    # checkpoint is the newest unless the signal came between its end and its save
    newest = max(int(p.parent.parent.name.split(".")[1]) for p in (run / "ckpt").glob("local.*/rank-0/COMMIT"))
    assert newest <= info["last_epoch"] <= newest + 1
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert _final(run) == _final(reference)


def test_corrupt_latest_checkpoint_is_skipped(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    info = json.loads((run / "run.json").read_text())
    info["status"] = "running"
    (run / "run.json").write_text(json.dumps(info))
    # flip one byte in the newest checkpoint's tensors, remove the marker of the one before
    tensors = run / "ckpt" / "local.6" / "rank-0" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    (run / "ckpt" / "local.5" / "rank-0" / "COMMIT").unlink()
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert "skipping checkpoint epoch 6" in r.err and "skipping checkpoint epoch 5" in r.err  # as every warning
    assert "resumed from checkpoint epoch 4" in r.out
    assert _final(run) == _final(reference)


def test_a_skipped_epoch_whose_manifest_is_garbage_is_moved_aside_and_saved_again(reference, tmp_path):
    """Its rank directory no longer says it is jobrun's, so its save could not replace it
    (the last epoch's save failed, exit 1): the resume moves it aside, deleting nothing."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _unfinished(run)
    (run / "ckpt" / "local.6" / "rank-0" / "MANIFEST.json").write_text("garbage")
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert "warning: skipping checkpoint epoch 6: node 'local'" in r.err
    assert "resumed from checkpoint epoch 5" in r.out
    assert "NOT saved" not in r.text
    assert _final(run) == _final(reference)
    kept = [p for p in (run / "ckpt").glob(".deleting-local.6-*/rank-0/MANIFEST.json")]
    assert [p.read_text() for p in kept] == ["garbage"]
    assert kept[0].parent.parent.name in r.err and "look at it, then delete it" in r.err
    assert "Traceback" not in r.text


@pytest.mark.parametrize("damage", ["truncate", "missing-file", "missing-marker"])
def test_resume_named_bad_epoch_fails_clearly(reference, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ck = run / "ckpt" / "local.3" / "rank-0"
    if damage == "truncate":
        f = ck / "tensors.safetensors"
        f.write_bytes(f.read_bytes()[:20])
    elif damage == "missing-file":
        (ck / "values.json").unlink()
    else:
        (ck / "COMMIT").unlink()
    r = jobrun("resume", "--run-dir", run, "--epoch", "3")
    assert r.code == 1
    assert "checkpoint epoch 3 cannot be used" in r.err
    assert "complete epochs besides 3: 0, 1, 2, 4, 5, 6" in r.err  # not 3 itself
    assert "Traceback" not in r.text
    assert ckpt_values(run, 6) == _final(reference)  # nothing else touched


def test_resume_from_an_epoch_that_is_not_there_is_bad_input(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    r = jobrun("resume", "--run-dir", run, "--epoch", "7")
    assert r.code == 2, r.text  # commands.md: 2, bad input refused before anything ran
    assert f"error: no checkpoint of epoch 7 in {run / 'ckpt'}" in r.err
    assert "give one of the complete epochs: 0, 1, 2, 3, 4, 5, 6" in r.err
    assert "Traceback" not in r.text
    assert ckpt_values(run, 6) == _final(reference)


def _flip_last_byte(path: Path) -> None:
    """Damage a file so that only its checksum can tell (same size, same header)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _unfinished(run: Path) -> None:
    info = json.loads((run / "run.json").read_text())
    info["status"] = "running"
    (run / "run.json").write_text(json.dumps(info))


def _data_bytes(run: Path, epoch: int) -> int:
    """The bytes of an epoch's data files (what its checksums cover)."""
    rank = run / "ckpt" / f"local.{epoch}" / "rank-0"
    return sum((rank / name).stat().st_size for name in ("tensors.safetensors", "values.json"))


def _watch_reads(monkeypatch) -> dict[str, list]:
    """Count the bytes the store checksums, and record the epochs it loads whole (its public
    load; the launcher's look at a checkpoint's random state reads a few blobs: "peeked")."""
    from jobrun import store
    from jobrun.store import tensorfile

    seen: dict[str, list] = {"checksummed": [], "loaded": [], "peeked": []}
    update, load = tensorfile.Checksums.update, store.load

    def counting(self, data):
        seen["checksummed"].append(memoryview(data).nbytes)
        update(self, data)

    def loading(ckpt_dir, node, epoch, rank=0, **kw):
        seen["peeked" if kw.get("blobs") else "loaded"].append((node, epoch))
        return load(ckpt_dir, node, epoch, rank, **kw)

    monkeypatch.setattr(tensorfile.Checksums, "update", counting)
    monkeypatch.setattr(store, "load", loading)
    return seen


def test_resume_checksums_each_checkpoint_byte_once(reference, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    seen = _watch_reads(monkeypatch)
    # Epoch 6 is the last: the resumed job saves nothing, so every byte checksummed is a
    # byte of epoch 6 read back.
    r = jobrun("resume", "--run-dir", run, "--epoch", "6")
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 6" in r.out
    assert sum(seen["checksummed"]) == _data_bytes(run, 6)
    assert seen["loaded"] == [("local", 6)]


def test_resume_skips_a_damaged_epoch_and_reads_each_byte_once(reference, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _unfinished(run)
    _flip_last_byte(run / "ckpt" / "local.6" / "rank-0" / "tensors.safetensors")
    seen = _watch_reads(monkeypatch)
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert "warning: skipping checkpoint epoch 6: node 'local'" in r.err
    assert "checksum mismatch" in r.err
    assert "resumed from checkpoint epoch 5" in r.out
    # Epochs 6 (found damaged) and 5 checked once each before the job starts; the job
    # loads epoch 5 without checksumming it again. (The job then saves epoch 6 afresh,
    # which checksums its own files once as it writes them.)
    written = _data_bytes(run, 6)
    assert sum(seen["checksummed"]) == _data_bytes(reference, 6) + _data_bytes(run, 5) + written
    assert seen["loaded"] == [("local", 5)]
    assert _final(run) == _final(reference)

    seen["checksummed"].clear()
    seen["loaded"].clear()
    r = jobrun("resume", "--run-dir", run, "--epoch", "2")
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 2" in r.out
    saved = sum(_data_bytes(run, e) for e in range(3, 7))  # epochs 3..6 written again
    assert sum(seen["checksummed"]) == _data_bytes(run, 2) + saved
    assert seen["loaded"] == [("local", 2)]
    assert _final(run) == _final(reference)


def test_resume_named_epoch_with_bad_checksum_is_refused(reference, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _flip_last_byte(run / "ckpt" / "local.3" / "rank-0" / "tensors.safetensors")
    seen = _watch_reads(monkeypatch)
    r = jobrun("resume", "--run-dir", run, "--epoch", "3")
    assert r.code == 1
    assert "checkpoint epoch 3 cannot be used" in r.err and "checksum mismatch" in r.err
    # The checksum is wrong, but its files are all there: only reading them tells.
    assert "complete epochs besides 3: 0, 1, 2, 4, 5, 6" in r.err
    assert "Traceback" not in r.text and "resumed from" not in r.out
    assert seen["loaded"] == []  # refused before any worker started
    assert sum(seen["checksummed"]) == _data_bytes(run, 3)


def test_job_runner_without_the_launcher_still_checks_checksums(reference, tmp_path):
    from jobrun.errors import CheckpointError
    from jobrun.plans.compile import compile_file
    from jobrun.runner.job import JobConfig, JobRunner

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _flip_last_byte(run / "ckpt" / "local.3" / "rank-0" / "tensors.safetensors")
    plan = compile_file(run / "plan.yaml", run_dir=str(run), plan_dir=str(run))
    cfg = JobConfig(plan=plan, run_dir=run, plan_dir=run, device="cpu", resume_epoch=3)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        JobRunner(cfg).run()


@pytest.mark.parametrize("how", ["elastic", "torchrun"])
def test_every_worker_learns_the_epoch_was_verified(reference, tmp_path, monkeypatch, how):
    import torch.distributed.launcher.api as elastic

    from jobrun.runner import group, hosts, workers

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    info = json.loads((run / "run.json").read_text())
    info["replicas"] = 2
    (run / "run.json").write_text(json.dumps(info))
    started: list[tuple] = []
    monkeypatch.setattr(workers, "worker", lambda *args: started.append(args) or 0)
    monkeypatch.setattr(hosts, "worker", workers.worker)
    if how == "elastic":
        monkeypatch.setattr(elastic, "elastic_launch", lambda config, fn: lambda *args: {
            r: fn(*args) for r in range(config.nproc_per_node)})
    else:  # every process checks its own rank with the others, then runs its worker
        for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}.items():
            monkeypatch.setenv(key, value)
        published: dict = {}
        monkeypatch.setattr(group, "rendezvous_store", lambda: published)
        monkeypatch.setattr(group, "publish", lambda store, name, obj: store.__setitem__(name, obj))
        monkeypatch.setattr(group, "start", lambda device, store=None: None)
        monkeypatch.setattr(group, "gather", lambda obj: [obj])
    seen = _watch_reads(monkeypatch)
    # (--replicas 2: the checkpoint was written by one)
    r = jobrun("resume", "--run-dir", run, "--epoch", "3", *(["--replicas", "2"] if how == "elastic" else []))
    assert r.code == 0, r.text
    assert sum(seen["checksummed"]) == _data_bytes(run, 3)  # checked once, by the launcher
    started_as = [(a[0].run_dir, a[0].resume_epoch, a[0].verified) for a in started]
    assert started_as == [(run, 3, True)] * (2 if how == "elastic" else 1)


def _as_ranks(n: int, fn) -> list:
    """fn(rank, gather) on n threads at once, gather being an all-gather between them (as
    torch.distributed's between processes); each one's result or exception."""
    import threading

    barrier, slots, out = threading.Barrier(n), [None] * n, [None] * n

    def gather_for(rank: int):
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            got = list(slots)
            barrier.wait()
            return got
        return gather

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, gather_for(rank))
        except Exception as e:  # noqa: BLE001 - compared by the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture
def two_ranks(tmp_path):
    """A plan and 4 epochs saved by 2 ranks."""
    import torch

    from jobrun import store
    from jobrun.plans.compile import compile_text

    plan = compile_text("job: j\nmax_epochs: 9\ncheckpoint: {dir: c}\n"
                        "epoch: [{task: t, do: [{const: {out: x, value: 1}}]}]\n")
    import random

    import numpy as np

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "node": torch.Generator().get_state(), "ctx_state": {}}
    for epoch in range(4):
        for rank in range(2):
            store.save({"w": torch.full((1000,), float(epoch * 10 + rank)), "jobrun:rng": rng}, {},
                       tmp_path, "local", epoch, rank=rank, world_size=2)
    return plan, tmp_path


def test_torchrun_processes_checksum_their_own_rank_and_agree(two_ranks, monkeypatch, capsys):
    import threading

    from jobrun import store
    from jobrun.errors import CheckpointError
    from jobrun.runner.pick import pick_epoch

    def _pick_epoch(ckpt, plan, replicas, epoch, rank, gather):
        return pick_epoch(ckpt, plan, replicas, epoch, rank=rank, gather=gather)[0]

    plan, ckpt = two_ranks
    _flip_last_byte(ckpt / "local.3" / "rank-1" / "tensors.safetensors")
    (ckpt / "local.2" / "rank-0" / "COMMIT").unlink()  # epoch 2: an interrupted save
    verified: list[tuple] = []
    verify = store.verify

    def record(ckpt_dir, node, epoch, rank=None, hashes=True, **kw):
        if hashes:
            verified.append((threading.current_thread().name, epoch, rank))
        return verify(ckpt_dir, node, epoch, rank, hashes=hashes, **kw)

    monkeypatch.setattr(store, "verify", record)
    got = _as_ranks(2, lambda rank, gather: _pick_epoch(ckpt, plan, 2, None, rank, gather))
    assert got == [1, 1]  # 3 is corrupt on rank 1 only, 2 incomplete: both pick 1
    out = capsys.readouterr().err
    assert out.count("warning: skipping checkpoint epoch 3:") == 1  # rank 0 says it, once
    assert "rank-1/tensors.safetensors: checksum mismatch" in out
    assert "warning: skipping checkpoint epoch 2: node 'local'" in out and "COMMIT" in out
    by_thread: dict[str, set] = {}
    for thread, epoch, rank in verified:
        by_thread.setdefault(thread, set()).add((epoch, rank))
    # Each process read only its own rank, of the two epochs it had to check.
    assert sorted(map(sorted, by_thread.values())) == [[(1, 0), (3, 0)], [(1, 1), (3, 1)]]
    got = _as_ranks(2, lambda rank, gather: _pick_epoch(ckpt, plan, 2, 3, rank, gather))
    assert all(isinstance(e, CheckpointError) and "epoch 3 cannot be used" in e.message
               and "rank-1" in e.message for e in got)
    # The hint names the epochs that can be tried instead: not 2, whose COMMIT is missing.
    assert all(e.hint.startswith("complete epochs besides 3: 0, 1 (") for e in got), got[0].hint
    assert _as_ranks(2, lambda rank, gather: _pick_epoch(ckpt, plan, 2, 0, rank, gather)) == [0, 0]


def test_a_checkpoint_of_two_ranks_goes_to_another_number_only_when_asked(two_ranks, tmp_path):
    from jobrun.errors import CheckpointError
    from jobrun.runner.pick import pick_epoch

    plan, ckpt = two_ranks
    # One process (`jobrun resume`) checks every rank.
    with pytest.raises(CheckpointError) as e:
        pick_epoch(ckpt, plan, 1, None)
    assert "written by 2 replicas; this run has 1" in e.value.message
    assert "resume with 2 replicas (--replicas 2)" in e.value.hint
    assert pick_epoch(ckpt, plan, 1, None, change_ok=True) == (3, 2)
    # Ranks that check their own files (torchrun, restarts): rank 2, which the checkpoint
    # has no files of, checks rank 0's (the ones it restores).
    got = _as_ranks(3, lambda rank, gather: pick_epoch(ckpt, plan, 3, None, change_ok=True,
                                                       rank=rank, gather=gather))
    assert got == [(3, 2)] * 3
    got = _as_ranks(3, lambda rank, gather: pick_epoch(ckpt, plan, 3, None, rank=rank, gather=gather))
    assert all(isinstance(e, CheckpointError) and "--replicas 2" in e.hint for e in got)
    # No shared disk: each rank sees its own rank's files only, and they agree.
    for rank in (0, 1):
        for epoch in range(4):
            src = ckpt / f"local.{epoch}" / f"rank-{rank}"
            shutil.copytree(src, tmp_path / f"host{rank}" / f"local.{epoch}" / f"rank-{rank}")
    _flip_last_byte(tmp_path / "host1" / "local.3" / "rank-1" / "tensors.safetensors")
    got = _as_ranks(2, lambda rank, gather: pick_epoch(tmp_path / f"host{rank}", plan, 2, None,
                                                       rank=rank, gather=gather))
    assert got == [(2, 2), (2, 2)]  # rank 1's epoch 3 is damaged: both go back to 2


@pytest.mark.slow
def test_two_runners_cannot_share_a_run_dir(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[1.0]"))
    run = tmp_path / "run"
    proc = _start(plan, run)
    try:
        deadline = time.time() + HANG_S
        while time.time() < deadline and not (run / "ckpt").exists():
            time.sleep(0.05)
        r = jobrun("resume", "--run-dir", run)
        assert r.code == 2
        assert "is in use by pid" in r.err
    finally:
        proc.kill()
        proc.wait()


def test_unwritable_checkpoint_dir_warns_and_training_goes_on(tmp_path, monkeypatch):
    # A file where a directory should be. `train` refuses such a checkpoint.dir before it
    # starts; one that becomes unwritable later (a disk gone) is this: every save fails.
    from jobrun.runner import rundir

    monkeypatch.setattr(rundir, "_check_checkpoint_dir", lambda checkpoint_dir, outside: None)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt", f"dir: {blocker}/ckpt"))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run", "seed=3")
    assert r.code == 1, r.text
    assert r.err.count("was NOT saved") == 8  # epochs 0-6 warn, and the error that ends the run says it
    assert [x["steps"] for x in logged(tmp_path / "run")] == [3, 6, 9, 12, 15, 18]
    # The command to paste: the run's plan and overrides, over the run (no `...`).
    assert "(no checkpoint of it was saved)" in r.err and "then train it again (`jobrun train " \
        f"{plan} seed=3 --run-dir {tmp_path / 'run'} --overwrite`)" in r.err, r.err


def _disk_full_at(monkeypatch, failing_epoch: int) -> None:
    """Make the checkpoint store fail one epoch's write as a full disk would."""
    from jobrun import store
    from jobrun.errors import CheckpointError

    real_write = store.write

    def flaky(prepared, ckpt_dir, node, epoch, **kw):
        if epoch == failing_epoch:
            raise CheckpointError("no space left on device while writing tensors.safetensors")
        return real_write(prepared, ckpt_dir, node, epoch, **kw)

    monkeypatch.setattr(store, "write", flaky)


def test_disk_full_during_save_warns_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    _disk_full_at(monkeypatch, 2)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    assert "checkpoint of epoch 2" in r.err and "no space left" in r.err
    assert not (run / "ckpt" / "local.2" / "rank-0" / "COMMIT").exists()
    assert ckpt_values(run, 1)["steps"] == 3 and ckpt_values(run, 6)["steps"] == 18


@pytest.mark.parametrize("background", ["false", "true"])
def test_disk_full_at_the_last_save_fails_the_run_and_resume_finishes_it(reference, tmp_path, monkeypatch,
                                                                          background):
    # The OS says ENOSPC while the last epoch's tensors are written: the run has not
    # finished (exit 1, one message saying how to go on), epoch 5 stays, a resume ends it.
    import errno

    from jobrun.store import files

    real_write = files.tensorfile.write

    def full(path, *args):
        if path.parent.parent.name == "local.6":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, *args)

    monkeypatch.setattr(files.tensorfile, "write", full)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt}", f"dir: ckpt, async: {background}}}"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 1 and "Traceback" not in r.text, r.text
    error = r.err[r.err.rindex("\nerror: ") + 1:]  # after the warnings
    assert error.startswith("error: the checkpoint of epoch 6, the last, was NOT saved: no space left on "
                            f"device while writing {run / 'ckpt' / 'local.6' / 'rank-0'}"), error
    assert "its newest checkpoint is epoch 5" in error and f"`jobrun resume {run}`" in error
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    assert ckpt_values(run, 5)["steps"] == 15
    assert "INVALID" not in jobrun("ckpt", "list", run).out  # the failed save left nothing
    monkeypatch.setattr(files.tensorfile, "write", real_write)  # space was freed
    again = jobrun("resume", run)
    assert again.code == 0 and "resumed from checkpoint epoch 5" in again.out, again.text
    assert "skipping" not in again.text
    assert _final(run) == _final(reference)


@pytest.mark.parametrize("args, background", [
    ((), "false"), ((), "true"),  # async: the last epoch is written after the last prune of an epoch
    pytest.param(("--replicas", "2"), "true", marks=pytest.mark.slow),
])
def test_keep_retains_only_the_last_epochs(tmp_path, args, background):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt}",
                                                            f"dir: ckpt, keep: 2, async: {background}}}"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run, *args)
    assert r.code == 0, r.text
    assert sorted(p.name for p in (run / "ckpt").iterdir() if not p.name.startswith(".")) == [
        "local.5",
        "local.6",
    ]
    # With replicas, torch's agent replaced this process's handlers (with ones raising its
    # SignalException): the launcher puts the earlier ones back, for a later command here.
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    assert not any(getattr(h, "__module__", "").startswith("torch") for h in handlers), handlers


def _stopped_before_the_last_prune(tmp_path, monkeypatch, keep: int) -> Path:
    """A run of PLAN stopped between its last save and that save's prune (a signal with
    replicas, a kill): it holds keep + 1 epochs."""
    from jobrun import store

    real_prune = store.prune

    def stopped(ckpt_dir, *args, **kw):
        if (Path(ckpt_dir) / "local.6").exists():
            raise KeyboardInterrupt
        return real_prune(ckpt_dir, *args, **kw)

    monkeypatch.setattr(store, "prune", stopped)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt}", f"dir: ckpt, keep: {keep}}}"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 130
    assert store.complete_epochs(run / "ckpt", ["local"]) == list(range(6 - keep, 7))
    monkeypatch.setattr(store, "prune", real_prune)
    return run


def test_a_resume_prunes_what_a_stop_before_the_last_prune_left(tmp_path, monkeypatch):
    # Resumed at its end, the run saves nothing to prune after: the resume prunes.
    from jobrun import store

    run = _stopped_before_the_last_prune(tmp_path, monkeypatch, keep=2)
    r = jobrun("resume", run)
    assert r.code == 0 and "resumed from checkpoint epoch 6" in r.out, r.text
    assert store.complete_epochs(run / "ckpt", ["local"]) == [5, 6]


def test_a_resume_prunes_neither_its_epoch_nor_a_damaged_newer_one(reference, tmp_path, monkeypatch):
    # keep: 1, epoch 6 damaged (its checksum fails): the resume goes on from 5, which its
    # prune keeps (a failed save of 6 leaves it to go on from), and a save of 6 replaces
    # the damaged one.
    from jobrun import store

    run = _stopped_before_the_last_prune(tmp_path, monkeypatch, keep=1)
    tensors = run / "ckpt" / "local.6" / "rank-0" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    real_write = store.write
    _disk_full_at(monkeypatch, 6)
    r = jobrun("resume", run)
    assert r.code == 1 and "resumed from checkpoint epoch 5" in r.out, r.text
    monkeypatch.setattr(store, "write", real_write)
    r = jobrun("resume", run)
    assert r.code == 0 and "resumed from checkpoint epoch 5" in r.out, r.text
    assert store.complete_epochs(run / "ckpt", ["local"]) == [6]
    assert _final(run) == _final(reference)


def test_upload_copies_last_checkpoint(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt}", "dir: ckpt, upload: shipped}")
    )
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    assert (run / "shipped" / "local").is_dir()
    assert any((run / "shipped" / "local").rglob("tensors.safetensors"))


def test_a_run_killed_after_training_uploads_its_last_epoch_on_resume(tmp_path):
    """The job fails in `exit` (after the upload): resume goes on from the last epoch and
    uploads that epoch again, not checkpoint 0."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt}", "dir: ckpt, upload: shipped, keep: null}")
        + "exit:\n  - task: bye\n    do: [{call: {fn: \"jobrun_test_helpers:fail_once\", "
          "path: \"${run_dir}/../failed\"}}]\n"
    )
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 1
    shutil.rmtree(run / "shipped")
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 6" in r.out and "uploaded local epoch 6" in r.out
    manifest = json.loads((run / "shipped" / "local" / "rank-0" / "MANIFEST.json").read_text())
    assert manifest["epoch"] == 6


def test_ckpt_list_show_export(reference, tmp_path):
    r = jobrun("ckpt", "list", reference)
    assert r.code == 0
    lines = r.out.splitlines()
    assert len(lines) == 1 + 7 and all(line.rstrip().endswith("ok") for line in lines[1:])
    r = jobrun("ckpt", "list", reference, "--json", "--verify")
    rows = json.loads(r.out)["checkpoints"]
    assert [row["epoch"] for row in rows] == list(range(7)) and all(row["valid"] for row in rows)

    r = jobrun("ckpt", "show", reference, "--epoch", "6", "--blob", "steps")
    assert r.code == 0 and "steps = 18" in r.out
    r = jobrun("ckpt", "show", reference, "--epoch", "99")
    assert r.code == 2 and "no checkpoint of epoch 99" in r.err and "0, 1, 2, 3, 4, 5, 6" in r.err
    r = jobrun("ckpt", "show", reference, "--epoch", "6", "--blob", "nope")
    assert r.code == 2 and "has no blob 'nope'" in r.err
    assert "add one init made and nothing changes to `checkpoint.include`" in r.err  # why it may be missing

    out = tmp_path / "w.safetensors"
    r = jobrun("export", reference, "--epoch", "6", "--blob", "w", "-o", out)
    assert r.code == 0, r.text
    from safetensors.numpy import load_file

    w = load_file(out)["w"]
    assert [round(float(v), 6) for v in w] == [round(v, 6) for v in ckpt_values(reference, 6)["w"]]


def test_ckpt_commands_do_not_import_torch(reference):
    code = (
        "import sys; from click.testing import CliRunner; from jobrun.cli import main;"
        f"r = CliRunner().invoke(main, ['ckpt', 'show', {str(reference)!r}, '--epoch', '6', '--json']);"
        "assert r.exit_code == 0, r.output; print('torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert p.stdout.strip() == "False", p.stderr


def test_async_checkpoints_resume_bit_exact(reference, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt}", "dir: ckpt, async: true}"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    assert "async (" in r.out and "ms blocked)" in r.out
    assert _final(run) == _final(reference)
    r = jobrun("resume", "--run-dir", run, "--epoch", "2")
    assert r.code == 0, r.text
    assert _final(run) == _final(reference)
    assert jobrun("ckpt", "list", run, "--verify", "--json").out.count('"valid": true') == 7


ADAM_PLAN = """
job: adam
seed: 1
max_epochs: 3
checkpoint: {dir: ckpt, async: ASYNC}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 6, classes: 3, seed: 0}
      - reader: {in: [x, y], out: data, batch_size: 16, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [6, 10, 3]}
      - optimizer: {in: model, out: opt, target: torch.optim.Adam, lr: 0.01}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: data, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss}
    outputs: [loss]
"""


def test_async_saves_write_the_same_bytes_as_sync_saves(tmp_path):
    """Adam creates its state at its first step: async copies it into new memory once, then
    into the same buffers; every file is the one a synchronous save writes."""
    runs = {}
    for mode in ("true", "false"):
        plan = tmp_path / f"plan-{mode}.yaml"
        plan.write_text(ADAM_PLAN.replace("ASYNC", mode))
        r = jobrun("train", plan, "--run-dir", tmp_path / mode)
        assert r.code == 0, r.text
        runs[mode] = tmp_path / mode
    for epoch in (0, 1, 2, 3):
        for name in ("tensors.safetensors", "values.json"):
            a = (runs["true"] / "ckpt" / f"local.{epoch}" / "rank-0" / name).read_bytes()
            b = (runs["false"] / "ckpt" / f"local.{epoch}" / "rank-0" / name).read_bytes()
            assert a == b and len(a) > 100, (epoch, name)


def test_async_save_failure_is_reported(tmp_path, monkeypatch):
    _disk_full_at(monkeypatch, 3)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("[0.15]", "[0.0]").replace("dir: ckpt}", "dir: ckpt, async: true}"))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    assert r.err.count("checkpoint of epoch 3 was NOT saved") == 2  # when found, and in the summary
