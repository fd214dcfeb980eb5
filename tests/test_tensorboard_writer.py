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
