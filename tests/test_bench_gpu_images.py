"""The gpu section's image rows (benchmarks/gpu_images.py) run on the CPU at a tiny size:
the four sides it times (jobrun with the look-ahead on, then off, a naive hand loop, a
hand loop with the look-ahead's pattern) compute the same numbers bit for bit, and the
benchmark's switch really turns the look-ahead off and back on."""

from __future__ import annotations

import pytest
import torch
from test_gpt import one_thread  # noqa: F401 - a fixture: one torch thread (a small shared machine)

from benchmarks import gpu_images
from benchmarks.bench_gpu import _HostReads
from benchmarks.common import Mode
from jobrun.ops.reader import Reader, TensorReader


@pytest.mark.usefixtures("one_thread")
def test_the_image_rows_sides_compute_the_same_losses_and_the_switch_takes_effect(monkeypatch):
    # The path a reader sending batches to a GPU takes (on the CPU a plain reader has a
    # shortcut of its own that does not prepare through `_prepare`).
    monkeypatch.setattr(TensorReader, "_plain_fields", lambda self: False)
    real = Reader._prepare
    reads = _HostReads()
    try:
        rows = gpu_images.rows(Mode("smoke"), reads, device="cpu", size=gpu_images.TINY, steps=5)
    finally:
        reads.restore()
    assert Reader._prepare is real  # the switch is undone
    assert [r.name for r in rows] == [
        "image batches (4x3x8x8 float32, 0.0 MB) steps/s (cpu)", "image batches: look-ahead on / off",
        "image batches: jobrun / naive hand loop", "host syncs per step (image batches, jobrun)"]
    extra = rows[0].extra
    assert len(extra["on_epoch_seconds"]) == len(extra["off_epoch_seconds"]) == 2
    assert len(extra["naive_epoch_seconds"]) == len(extra["prefetch_epoch_seconds"]) == 4
    losses = extra["losses"]
    # bit for bit: jobrun, look-ahead on or off, and the hand loops read the same batches
    assert len(losses["jobrun"]) == 4 and losses["jobrun"] == losses["naive"] == losses["prefetch"]
    assert len(set(losses["jobrun"])) == 4 and extra["same_losses"]  # and training moved the loss
    # on: each read but a pass's last prepares the next batch (6 batches a pass: 5 prepared
    # in epoch 1, 4 in epoch 3, pass 2 ending there); off: none is prepared
    assert extra["prepared"] == {"on": 9, "off_skipped": 8, "off_prepared": 0}
    assert rows[1].extra["switched"] and len(rows[1].extra["pairs"]) == 1
    assert all(r.ratio > 0 for r in rows[:3])
    assert rows[3].value == 0 and rows[3].ok  # nothing on the CPU is a device read


def test_the_hand_prefetch_loop_hands_out_the_batch_it_prepared():
    x, y = gpu_images.images(12, 4)
    loop = gpu_images.HandLoop(gpu_images.Size(n=12, batch=4, side=4, width=2), "cpu", (x, y), prefetch=True)
    first = loop._batch()
    ahead = loop.ahead[0]
    second = loop._batch()
    assert all(a is b for a, b in zip(second, ahead))
    order = gpu_images.ReaderBatches(12, 4)
    for got in (first, second):
        idx = order.next()
        assert torch.equal(got[0], x[idx]) and torch.equal(got[1], y[idx])
