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
from jobrun.ops.reader import Reader
from jobrun.ops.tensor_reader import TensorReader


@pytest.mark.usefixtures("one_thread")
def test_the_image_rows_sides_compute_the_same_losses_and_the_switch_takes_effect(monkeypatch):
    # The path a reader sending batches to a GPU takes: preparing on the look-ahead's
    # thread (on the CPU a plain reader has a shortcut of its own that prepares inline).
    monkeypatch.setattr(TensorReader, "_plain_fields", lambda self: False)
    made = []
    init = TensorReader.__init__

    def threaded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._threaded = True
        made.append(self)

    monkeypatch.setattr(TensorReader, "__init__", threaded)
    real = Reader._prepare
    reads = _HostReads()
    try:
        rows = gpu_images.rows(Mode("smoke"), reads, device="cpu", size=gpu_images.TINY, steps=5)
    finally:
        reads.restore()
    assert Reader._prepare is real  # the switch is undone
    assert len(made) == 2 and all(r._to_device._thread is not None for r in made)  # prepared on it
    image = "image batches (4x3x8x8 float32, 0.0 MB) steps/s (cpu)"
    synced = "image batches, loss read every step"
    assert [r.name for r in rows] == [
        image, "image batches: look-ahead on / off", "image batches: jobrun / naive hand loop",
        "image batches: hand look-ahead in a thread / in the loop", "host syncs per step (image batches, jobrun)",
        image.replace("image batches", synced), f"{synced}: look-ahead on / off",
        f"{synced}: jobrun / naive hand loop", f"{synced}: hand look-ahead in a thread / in the loop"]
    for first, sync in ((rows[0], False), (rows[5], True)):
        extra = first.extra
        assert extra["sync_every_step"] is sync
        assert len(extra["on_epoch_seconds"]) == len(extra["off_epoch_seconds"]) == 2
        assert [len(t) for t in extra["hand_epoch_seconds"].values()] == [4, 4, 4]
        losses = extra["losses"]
        # bit for bit: jobrun, look-ahead on or off, and the hand loops read the same batches
        assert list(losses) == ["jobrun", "naive", "ahead", "thread"]
        assert len(losses["jobrun"]) == 4 and all(losses[k] == losses["jobrun"] for k in losses)
        assert len(set(losses["jobrun"])) == 4 and extra["same_losses"]  # and training moved the loss
        # on: each read but a pass's last prepares the next batch (6 batches a pass: 5
        # prepared in epoch 1, 4 in epoch 3, pass 2 ending there); off: none is prepared
        assert extra["prepared"] == {"on": 9, "off_skipped": 8, "off_prepared": 0}
        assert [len(p) for p in extra["pairs"].values()] == [1, 1, 1, 3]
    assert rows[1].extra["switched"] and rows[6].extra["switched"]
    assert all(r.ratio > 0 for r in rows if "syncs" not in r.name)
    assert rows[4].value == 0 and rows[4].ok  # nothing on the CPU is a device read


def test_the_hand_look_ahead_loops_hand_out_the_batches_in_the_readers_order():
    x, y = gpu_images.images(12, 4)
    size = gpu_images.Size(n=12, batch=4, side=4, width=2)
    loop = gpu_images.HandLoop(size, "cpu", (x, y), gpu_images.AHEAD)
    first = loop._batch()
    ahead = loop.ahead[0]
    second = loop._batch()
    assert all(a is b for a, b in zip(second, ahead))
    threaded = gpu_images.HandLoop(size, "cpu", (x, y), gpu_images.THREAD)
    try:
        batches = [threaded._batch() for _ in range(5)]  # across a pass's end
    finally:
        threaded.close()
    assert not threaded._thread.is_alive()
    order = gpu_images.ReaderBatches(12, 4)
    for got, other in zip([first, second], batches):
        idx = order.next()
        assert torch.equal(got[0], x[idx]) and torch.equal(got[1], y[idx])
        assert torch.equal(other[0], x[idx]) and torch.equal(other[1], y[idx])
    for other in batches[2:]:
        idx = order.next()
        assert torch.equal(other[0], x[idx]) and torch.equal(other[1], y[idx])
