"""Throughput and memory: samples/s (tokens/s), the data wait, peak memory, per epoch."""

from __future__ import annotations

import resource
import time

import pytest
import torch
from runner_util import jobrun, metrics
from test_profile import PLAN

from jobrun.runner.display import Display, human_size
from jobrun.runner.throughput import EpochRates, Feed, epoch_text, peak_memory


def test_feed_counts_records_tokens_and_the_wait():
    feed = Feed()
    feed.add((torch.zeros(4, 8, dtype=torch.long), torch.zeros(4), False), 0.25)
    assert feed.snapshot() == (4, 32, 0.25)  # integer (batch, sequence): 4 sequences of 8 tokens
    feed.add((torch.zeros(6, 8), torch.zeros(6), False), 0.5)  # float features: no tokens
    feed.add((torch.zeros(3, 2, 5, dtype=torch.int32), False), 0.0)  # not (batch, sequence)
    feed.add((torch.zeros(2, 8, dtype=torch.bool), False), 0.0)  # masks are not tokens
    feed.add((None, None, True), 0.125)  # the end of a pass: waited, no records
    assert feed.snapshot() == (4 + 6 + 3 + 2, 32, 0.875)
    feed.add((7, False), 0.0)  # an unbatched record (batch_size 1)
    feed.add((torch.tensor(3.0), False), 0.0)  # one 0-dim record
    assert feed.records == 17


def test_each_reader_has_a_tally_and_the_feed_sums_them():
    """`read` adds to its reader's tally under the reader's lock: the feed takes none."""
    from jobrun.ops.context import OpContext
    from jobrun.ops.reader import read_op, reader_op

    feed = Feed()
    ctx = OpContext(progress={"feed": feed})
    tokens = reader_op(ctx, torch.zeros(10, 4, dtype=torch.long), batch_size=4)
    floats = reader_op(ctx, torch.zeros(6, 3), torch.zeros(6), batch_size=6)
    for _ in range(4):  # 4 + 4 + 2, then the end of the pass
        read_op(ctx, tokens)
    read_op(ctx, floats)
    assert len(feed.tallies) == 2
    assert [t[:2] for t in feed.tallies.values()] == [[10, 40], [6, 0]]
    records, n_tokens, wait = feed.snapshot()
    assert (records, n_tokens) == (16, 40) and feed.records == 16 and feed.tokens == 40
    assert wait == sum(t[2] for t in feed.tallies.values()) > 0


def test_epoch_rates_are_over_the_epoch_and_count_every_replica():
    feed = Feed()
    rates = EpochRates(feed, "cpu", world_size=2)
    feed.add((torch.zeros(10, 4, dtype=torch.long), False), 0.5)
    r = rates.finish(2.0)
    assert r["samples_per_s"] == 10 * 2 / 2.0 and r["tokens_per_s"] == 40 * 2 / 2.0
    assert r["data_s"] == 0.5 and r["compute_s"] == 1.5
    assert r["peak_memory_bytes"] >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - 1
    text = epoch_text(r, 2.0, human_size)
    assert text.startswith("40 tokens/s  data 25%  peak ")
    assert "samples_per_s" not in EpochRates(feed, "cpu", 1).finish(1.0)  # nothing read


def test_epoch_records_and_line_show_throughput_and_memory(plan_file, tmp_path):
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(PLAN), "--run-dir", run_dir)
    assert r.code == 0, r.text
    epochs = [m for m in metrics(run_dir) if m.get("event") == "epoch"]
    assert len(epochs) == 3
    for e in epochs:
        # 96 records a pass of batches of 16, one pass an epoch.
        assert e["samples_per_s"] * e["seconds"] == pytest.approx(96, rel=1e-3)
        assert e["data_s"] + e["compute_s"] == pytest.approx(e["seconds"], abs=1e-5)
        assert 0 < e["data_s"] < e["seconds"]
        assert e["peak_memory_bytes"] > 1 << 20 and "tokens_per_s" not in e
    lines = [line for line in r.out.splitlines() if line.startswith("epoch ")]
    assert all(" samples/s  data " in line and "  peak " in line for line in lines), lines


def test_the_heartbeat_line_shows_samples_per_second(capsys):
    d = Display(enabled=True, tty=False, heartbeat=0.0)
    feed = Feed()
    with d.live("j"):
        d.progress["feed"] = feed
        d.status("epoch 1")
        feed.add((torch.zeros(50, 3), False), 0.0)
        d.progress["loop"] = ("train", 4, 10)
        time.sleep(0.05)
        d._refresh()
        d.status("epoch 2")
        feed.add((torch.zeros(50, 3, dtype=torch.long), False), 0.0)  # sequences: tokens/s
        d.progress["loop"] = ("train", 6, 10)
        time.sleep(0.05)
        d._refresh()
    out = capsys.readouterr().out.splitlines()
    assert " samples/s, " in [x for x in out if "epoch 1: step 5/10" in x][0]
    assert " tokens/s, " in [x for x in out if "epoch 2: step 7/10" in x][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_peak_memory_is_the_allocator_peak_of_the_epoch():
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    rates = EpochRates(Feed(), "cuda", 1)  # resets the peak
    y = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    peak = rates.finish(1.0)["peak_memory_bytes"]
    assert 8 << 20 <= peak < 64 << 20
    assert peak_memory("cuda") == peak
    del y
