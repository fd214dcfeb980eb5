"""Throughput and memory: samples/s (tokens/s), the data wait, peak memory, per epoch."""

from __future__ import annotations

import resource
import time
import types

import numpy as np
import pytest
import torch
from runner_util import jobrun, metrics
from test_profile import PLAN

from jobrun.ops.batches import counts
from jobrun.runner.display import FOREVER, Display, human_size
from jobrun.runner.throughput import EpochRates, Feed, epoch_text, peak_memory


def test_the_rule_counts_records_and_tokens_of_a_batch():
    assert counts((torch.zeros(4, 8, dtype=torch.long), torch.zeros(4))) == (4, 32)  # 4 sequences of 8 tokens
    assert counts((np.zeros((3, 5), dtype=np.int32),)) == (3, 15)  # numpy token ids too
    assert counts((torch.zeros(6, 8), torch.zeros(6))) == (6, 0)  # float features: no tokens
    assert counts((torch.zeros(3, 2, 5, dtype=torch.int32),)) == (3, 0)  # not (batch, sequence)
    assert counts((torch.zeros(2, 8, dtype=torch.bool),)) == (2, 0)  # masks are not tokens
    assert counts((7,)) == (1, 0) and counts((torch.tensor(3.0),)) == (1, 0)  # one record
    assert counts(({},)) == (0, 0)


class Rows(torch.utils.data.Dataset):
    """Token rows of a length of their own: the collated batch is padded to its longest."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2 + i % 3,), i, dtype=torch.long)


def _pad(items: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(items, batch_first=True)


@pytest.mark.parametrize("make", ["tensor", "shuffled", "keyed", "keyed_text", "windows", "dataset", "ones"])
def test_every_reader_counts_what_it_hands_out_as_the_rule_counts_its_batches(make):
    """Readers count their own batches (a reader of records of one shape from the batch
    bounds, a Dataset's batch by the rule): the counts equal the rule applied to every
    batch `read` handed out, the end of a pass counting nothing."""
    from jobrun.ops.context import OpContext
    from jobrun.ops.reader import read_op, reader_op

    ctx = OpContext()
    ids = torch.arange(70).reshape(10, 7)
    reader = {
        "tensor": lambda: reader_op(ctx, ids, torch.zeros(10), batch_size=4),
        "shuffled": lambda: reader_op(ctx, ids, torch.zeros(10), batch_size=4, shuffle=True),
        "keyed": lambda: reader_op(ctx, ids, torch.zeros(10), batch_size=4, shuffle=True, keys=["input_ids", "y"]),
        # a dict counted by its first batched value: the token ids, not the list of strings
        "keyed_text": lambda: reader_op(ctx, ["s"] * 10, ids, batch_size=4, keys=["text", "input_ids"]),
        "windows": lambda: reader_op(ctx, torch.arange(50), window=6, batch_size=3),
        "dataset": lambda: reader_op(ctx, Rows(10), batch_size=4, collate_fn="test_throughput:_pad"),
        "ones": lambda: reader_op(ctx, ids, torch.zeros(10), batch_size=1),
    }[make]()
    want = [0, 0]
    while True:
        names = ("x", "done") if make in ("keyed", "keyed_text", "dataset") else ("x", "y", "done")
        *fields, done = read_op(ctx, reader, names)
        if done:
            break
        n, tokens = counts(tuple(fields)) if make != "ones" else (1, 0)  # a single record is one
        want = [want[0] + n, want[1] + tokens]
    assert reader.tally[:2] == want and want[0] == {"windows": 8}.get(make, 10)
    assert want[1] > 0 or make == "ones"


def test_the_feed_sums_the_tallies_of_the_readers_read_in_its_run():
    """`read` adds its wait to its reader's tally under the reader's lock and the feed
    starts watching a reader at its first read: the feed takes no lock."""
    from jobrun.ops.context import OpContext
    from jobrun.ops.reader import read_op, reader_op

    feed = Feed()
    ctx = OpContext(progress={"feed": feed})
    tokens = reader_op(ctx, torch.zeros(10, 4, dtype=torch.long), batch_size=4)
    floats = reader_op(ctx, torch.zeros(6, 3), torch.zeros(6), batch_size=6)
    unread = reader_op(ctx, torch.zeros(6, 3), batch_size=6)
    for _ in range(4):  # 4 + 4 + 2, then the end of the pass
        read_op(ctx, tokens)
    read_op(ctx, floats)
    unread.read()  # read outside the op: counted by the reader, not watched by the feed
    assert len(feed.tallies) == 2 and tokens.feed is feed and unread.feed is None
    assert [t[:2] for t in feed.tallies] == [[10, 40], [6, 0]]
    records, n_tokens, wait = feed.snapshot()
    assert (records, n_tokens) == (16, 40) and feed.records == 16 and feed.tokens == 40
    assert wait == tokens.tally[2] + floats.tally[2] > 0


def _tally(feed: Feed, records: int, tokens: int, seconds: float = 0.0) -> None:
    """A reader's reads, as the feed sees them: its tally."""
    reader = types.SimpleNamespace(tally=[records, tokens, seconds], feed=None)
    feed.watch(reader)
    assert reader.feed is feed


class FixedRows(torch.utils.data.Dataset):
    """Token rows of one length (7)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((7,), i, dtype=torch.long)


class DictRows(FixedRows):
    """The same rows as dicts (a Hugging Face dataset's): a dict batch, whose tensors are
    tagged with the global batch's records, not the dict (counted 1/N of them)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": super().__getitem__(i), "labels": torch.tensor(i % 2)}


@pytest.mark.parametrize("make", ["tensor", "windows", "dataset", "dicts", "ones"])
def test_each_rank_counts_the_global_batches_its_parts_belong_to(make):
    """With replicas each rank reads its part of every global batch, the parts unequal
    when the batch does not divide (5 records on 2 ranks: 3 and 2). Every rank's tally
    is the global batches' (10 records of 7 tokens), so samples/s of rank 0 needs no
    multiplying by the ranks (which counted 12 for 10 here); a batch of single records,
    which every rank reads whole, counts once."""
    from jobrun.ops.context import OpContext
    from jobrun.ops.reader import read_op, reader_op

    ids = torch.arange(70).reshape(10, 7)
    tallies, parts = [], []
    for rank in (0, 1):
        ctx = OpContext(rank=rank, world_size=2)
        args, kw = {
            "tensor": ((ids, torch.zeros(10)), {"batch_size": 5, "shuffle": True}),
            "windows": ((torch.arange(71),), {"window": 7, "batch_size": 5}),
            "dataset": ((FixedRows(),), {"batch_size": 5}),
            "dicts": ((DictRows(),), {"batch_size": 5}),
            "ones": ((ids, torch.zeros(10)), {"batch_size": 1}),
        }[make]  # fmt: skip
        reader = reader_op(ctx, *args, **kw)
        names = ("x", "done") if make in ("dataset", "dicts") else ("x", "y", "done")
        sizes = []
        while not (batch := read_op(ctx, reader, names))[-1]:
            sizes.append(counts(tuple(batch[:-1]))[0] if make != "ones" else 1)
        tallies.append(reader.tally[:2])
        parts.append(sizes)
    if make == "ones":
        assert parts == [[1] * 10] * 2 and tallies == [[10, 0]] * 2  # every rank reads each one
    else:
        assert parts == [[3, 3], [2, 2]] and tallies == [[10, 70]] * 2


def test_epoch_rates_are_over_the_epoch():
    feed = Feed()
    rates = EpochRates(feed, "cpu")
    _tally(feed, 10, 40, 0.5)  # 10 sequences of 4 tokens, read in 0.5 s
    r = rates.finish(2.0)
    assert r["samples_per_s"] == 10 / 2.0 and r["tokens_per_s"] == 40 / 2.0
    assert r["data_s"] == 0.5 and r["compute_s"] == 1.5
    assert r["peak_memory_bytes"] >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - 1
    text = epoch_text(r, 2.0, human_size)
    assert text.startswith("20 tokens/s  data 25%  peak ")
    assert "samples_per_s" not in EpochRates(feed, "cpu").finish(1.0)  # nothing read


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
        _tally(feed, 50, 0)
        d.progress["loop"] = _running("train", 4, 10)
        time.sleep(0.05)
        d._refresh()
        d.status("epoch 2")
        _tally(feed, 50, 150)  # sequences: tokens/s
        d.progress["loop"] = _running("train", 6, 10)
        time.sleep(0.05)
        d._refresh()
    out = capsys.readouterr().out.splitlines()
    assert " samples/s, " in [x for x in out if "epoch 1: step 5/10" in x][0]
    assert " tokens/s, " in [x for x in out if "epoch 2: step 7/10" in x][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_peak_memory_is_the_allocator_peak_of_the_epoch():
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    rates = EpochRates(Feed(), "cuda")  # resets the peak
    y = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    peak = rates.finish(1.0)["peak_memory_bytes"]
    assert 8 << 20 <= peak < 64 << 20
    assert peak_memory("cuda") == peak
    del y


def test_evaluates_reads_of_a_reader_the_steps_read_too_are_not_counted():
    """samples/s are training's: `evaluate` with `batches` reads the reader `read` reads
    (moving it), and its batches count in neither the reader's tally nor the feed."""
    from jobrun.ops.context import OpContext
    from jobrun.ops.reader import read_op, reader_op
    from jobrun.ops.train import evaluate

    feed = Feed()
    ctx = OpContext(progress={"feed": feed})
    reader = reader_op(ctx, torch.randn(40, 3), torch.randint(0, 2, (40,)), batch_size=4, passes=0)
    read_op(ctx, reader)
    model = torch.nn.Linear(3, 2)
    evaluate(ctx, model, reader, batches=3)
    assert reader.position == 16  # evaluate moved it by 3 batches
    read_op(ctx, reader)
    assert feed.records == 8 and reader.tally[:2] == [8, 0]


def _running(task, i, n):
    """The display's entry of a loop in its iteration i (0-based), as the executor's."""
    iterator = iter(FOREVER if n is None else range(n))
    for _ in range(i + 1):
        next(iterator)
    return task, iterator, n, time.perf_counter()
