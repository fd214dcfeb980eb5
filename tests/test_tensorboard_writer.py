"""TensorBoard scalars are written by a thread of their own, batched (runner/records.py):
every value a `log` call gave reaches the event file by the run's end, at its step and
with the wall time of the call, not of the write."""

from __future__ import annotations

import time

import pytest

from jobrun.runner import records


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_are_written_at_close_with_the_time_of_their_log_call(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(records, "FLUSH_S", 3600.0)  # nothing is written before close
    tb = records.TensorBoard(tmp_path)
    before = time.time()
    tb.write("train", 3, {"loss": 0.5, "accuracy": 1, "done": True, "note": "text"})
    tb.write("train", 7, {"loss": 0.25})
    logged = time.time()
    assert tb.thread is not None and tb.pending  # kept for the thread, not written by the caller
    time.sleep(0.05)
    tb.close()
    got = _scalars(tmp_path / "tensorboard")
    assert sorted(got) == ["train/accuracy", "train/loss"]  # bools and strings are no scalars
    assert [(s, v) for s, v, _ in got["train/loss"]] == [(3, 0.5), (7, 0.25)]
    assert [(s, v) for s, v, _ in got["train/accuracy"]] == [(3, 1.0)]
    assert all(before <= w <= logged for s in got.values() for _, _, w in s)
    assert not tb.thread.is_alive()


def test_the_thread_writes_every_flush_period(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(records, "FLUSH_S", 0.01)
    tb = records.TensorBoard(tmp_path)
    tb.write("train", 1, {"loss": 2.0})
    deadline = time.monotonic() + 30
    while tb.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tb.pending  # taken by the thread before the run's end
    tb.close()
    assert [(s, v) for s, v, _ in _scalars(tmp_path / "tensorboard")["train/loss"]] == [(1, 2.0)]


def test_no_thread_without_tensorboard_values(tmp_path):
    pytest.importorskip("tensorboard")
    tb = records.TensorBoard(tmp_path)
    tb.write("train", 1, {"done": False, "name": "x"})
    assert tb.thread is None
    tb.close()


FAILS_IN_EPOCH_3 = """\
job: tb
max_epochs: 4
vars: {mark: 1}
checkpoint: {dir: ckpt, every: 2}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}
      - model.mlp: {out: model, sizes: [2, 1]}
      - optimizer: {in: model, out: opt, lr: 0.01}
      - const: {out: epoch_no, value: 0}
epoch:
  - task: t
    do:
      - add: {in: [epoch_no, 1], out: epoch_no}
      - loop: 2
        do:
          - train.step: {in: [model, opt, x, y], out: loss, loss: mse}
          - log: {in: [loss]}
      - train.step: {in: [model, opt, x, y], out: val, loss: mse}
      - const: {out: mark, value: "${mark}"}
      - log: {in: [val, mark]}
      - eq: {in: [epoch_no, 3], out: third}
      - if: third
        then: [{call: {fn: "jobrun_test_helpers:fail_once", path: "FAILED"}}]
"""


def test_a_resume_replaces_the_points_logged_after_its_checkpoint(tmp_path):
    """A run that failed in epoch 3 had written epoch 3's scalars; its resume from
    checkpoint 2 logs them again: TensorBoard shows each step once, the resume's value,
    and keeps the points of the checkpoint's own step (epoch 2's last, at step 6)."""
    pytest.importorskip("tensorboard")
    from runner_util import jobrun, metrics

    plan = tmp_path / "plan.yaml"
    plan.write_text(FAILS_IN_EPOCH_3.replace("FAILED", str(tmp_path / "failed")))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 1 and "bad luck" in r.err, r.text
    before = _scalars(run / "tensorboard")
    assert [s for s, _, _ in before["t/mark"]] == [3, 6, 9]  # epoch 3 logged before it failed
    r = jobrun("resume", "--run-dir", run, "vars.mark=2")
    assert r.code == 0 and "resumed from checkpoint epoch 2" in r.out, r.text
    got = {tag: [(s, v) for s, v, _ in points] for tag, points in _scalars(run / "tensorboard").items()}
    assert got["t/mark"] == [(3, 1.0), (6, 1.0), (9, 2.0), (12, 2.0)]
    logged = [(m["step"], m["values"]) for m in metrics(run) if "values" in m]
    for tag in ("loss", "val"):  # each step once, as metrics.jsonl holds it
        assert got[f"t/{tag}"] == [(s, pytest.approx(v[tag])) for s, v in logged if tag in v]
    assert [s for s, _ in got["t/loss"]] == [0, 1, 3, 4, 6, 7, 9, 10]
    assert [s for s, _ in got["t/val"]] == [3, 6, 9, 12]


FULL_DISK = """\
import errno, sys
from pathlib import Path
from tensorboard.summary.writer import record_writer
from jobrun.runner import records

def full(self, data):
    raise OSError(errno.ENOSPC, "No space left on device")

if sys.argv[2] == "start":
    record_writer.RecordWriter.write = full
tb = records.TensorBoard(Path(sys.argv[1]))
record_writer.RecordWriter.write = full
tb.write("train", 1, {"loss": 1.0})
tb.restart(0, lambda: [])
tb.write("train", 2, {"loss": 0.5})
tb.close()
print("writer", tb.writer)
"""


@pytest.mark.parametrize("when", ["start", "later"])
def test_an_event_file_that_cannot_be_written_is_one_warning_and_training_goes_on(tmp_path, when):
    """A full disk (or a tensorboard/ not writable) made the run's start end in tensorboard's
    traceback, twice: its writer thread's and the SummaryWriter's; scalars, as metrics
    lines, never stop a job."""
    pytest.importorskip("tensorboard")
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path), when], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "writer None\n", p.stderr
    assert "Traceback" not in p.stderr and "Exception in thread" not in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(
        f"warning: cannot write TensorBoard scalars in {tmp_path / 'tensorboard'} (No space left on device); "
        "no more are written, training goes on"), p.stderr
