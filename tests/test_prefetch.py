"""Look-ahead: a reader prepares the next batch of a pass when it hands one out (gathered,
its copy to the device started), and the next `read` hands that batch out. The batches,
the checkpointed state, the rank parts and their weight tags, the end of the data and
the failures are those of a reader that reads each batch when `read` runs."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from test_loader import Noisy, Stream, _reader, _reads
from torch.utils.data import TensorDataset

from jobrun.errors import RunError
from jobrun.ops.context import OpContext
from jobrun.ops.reader import Reader, read_op, reader_op
from jobrun.ops.split import global_records
from jobrun.ops.tensor_reader import TensorReader

TOKENS = torch.arange(1000, dtype=torch.int64) * 7 % 65


def _tensor_reader(rank: int = 0, world: int = 1, plain: bool = True, **args) -> Reader:
    x = torch.arange(26.0).reshape(13, 2)
    r = TensorReader([x, torch.arange(13)], rank=rank, world_size=world, seed=7, **args)
    r._plain = r._plain and plain
    return r


# Each kind of reader that looks ahead, at 13 records (windows: 13 in order) a pass. A
# plain one (CPU tensors in one process) gathers each batch when `read` runs.
MAKERS = {
    "tensors general": lambda **a: _tensor_reader(plain=False, **a),
    "windows in order": lambda rank=0, world=1, **a: reader_op(
        OpContext(seed=7, rank=rank, world_size=world), TOKENS[:105], window=8, **a),
    "dataset with workers": lambda rank=0, world=1, **a: _reader(
        TensorDataset(torch.arange(26.0).reshape(13, 2), torch.arange(13)), seed=7, rank=rank,
        world=world, num_workers=2, **a),
}


def _threaded(make):
    """A reader preparing on the look-ahead's thread, as readers sending to a GPU do."""
    def made(**a):
        r = make(**a)
        r._threaded = True
        return r
    return made


MAKERS.update({f"{k}, threaded": _threaded(v) for k, v in list(MAKERS.items())})


def _ahead(reader: Reader):
    """What the reader prepared (waited for when its thread prepares it), not taken."""
    ahead = reader._ahead
    return ahead.result() if isinstance(ahead, Future) else ahead


def _batch(fields) -> list:
    return ["done" if fields[-1] else [f.tolist() for f in fields[:-1]]]


def _run(reader: Reader, reads: int) -> list:
    return [(_batch(reader.read()), reader.state_dict()) for _ in range(reads)]


@pytest.mark.parametrize("kind", MAKERS)
def test_the_next_batch_of_the_pass_is_prepared_when_one_is_handed_out(kind):
    r = MAKERS[kind](batch_size=4, shuffle=True, passes=2)
    r.read()
    assert r._ahead is not None and r._ahead_at == r.state_dict()["position"] == 4
    prepared = _ahead(r)
    second = r.read()[:-1]
    assert all(a is b for a, b in zip(second, prepared))  # handed out as prepared
    r.read(), r.read()  # the pass's last batch (1 record): nothing left to prepare
    assert r._ahead is None
    assert r.read()[-1] is True and r._ahead is None  # done; the next pass starts at read


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize("at", [1, 2, 6])
def test_a_checkpoint_taken_while_a_batch_is_prepared_resumes_bit_for_bit(kind, at):
    """The state names the next batch to hand out, not the prepared one; loading a
    state (into a fresh reader or the same one) drops what was prepared."""
    args = dict(batch_size=4, shuffle=True, passes=0)
    r = MAKERS[kind](**args)
    for _ in range(at):
        r.read()
    assert r._ahead is not None  # a batch is prepared when the state is taken
    state = r.state_dict()
    expected = _run(r, 7)
    fresh = MAKERS[kind](**args)
    fresh.load_state_dict(state)
    assert _run(fresh, 7) == expected
    r.load_state_dict(state)  # back to the checkpoint, with another batch prepared
    assert _run(r, 7) == expected


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("at", [0, 1, 3, 4, 6])
def test_a_plain_reader_prepares_nothing_and_resumes_from_any_read_bit_for_bit(shuffle, at):
    """A plain reader gathers each batch when `read` runs; the state is its position,
    loaded into a fresh reader or the same one, mid-pass or at a pass's end."""
    args = dict(batch_size=4, shuffle=shuffle, passes=0)
    r = _tensor_reader(**args)
    assert r._plain
    for _ in range(at):
        r.read()
        assert r._ahead is None
    state = r.state_dict()
    expected = _run(r, 7)
    fresh = _tensor_reader(**args)
    fresh.load_state_dict(state)
    assert _run(fresh, 7) == expected
    r.load_state_dict(state)
    assert _run(r, 7) == expected
    general = _tensor_reader(plain=False, **args)
    general.load_state_dict(state)
    assert _run(general, 7) == expected


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_plain_reader_dropped_mid_pass_frees_its_fields_at_once(shuffle):
    """A plain reader's pass once held the reader (a generator of it): a cycle, so a
    reader made every epoch and left mid-pass (a loop of N steps) kept its data (52 MB an
    epoch) until the cyclic collector ran, epochs later."""
    import gc
    import weakref

    x = torch.arange(40.0).reshape(20, 2)
    r = TensorReader([x, x.sum(1)], batch_size=4, shuffle=shuffle)
    assert r._plain
    r.read()
    gone = weakref.ref(r)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del r
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("kind", MAKERS)
def test_look_ahead_reads_what_a_reader_without_it_reads(kind):
    """A reader whose prepared batches are dropped before every read reads each batch
    when `read` runs: the same batches, in the same layout, and the same states."""
    args = dict(batch_size=3, shuffle=True, passes=2, drop_last=not kind.startswith("windows in order"))
    ahead, now = MAKERS[kind](**args), MAKERS[kind](**args)
    got, expected = [], []
    for _ in range(13):
        got.append((_layout(ahead.read()), ahead.state_dict()))
        now._prepared(-1)  # what look-ahead prepared is never used: read at `read`
        if kind.startswith("dataset with workers"):
            now._stop()  # its iterator ran one batch ahead; restart at the position
        expected.append((_layout(now.read()), now.state_dict()))
    assert got == expected


def _layout(fields) -> list:
    return [None if f is None else (f.tolist(), f.dtype, tuple(f.shape), f.stride())
            for f in fields[:-1]] + [fields[-1]]


@pytest.mark.parametrize("kind", MAKERS)
def test_each_rank_reads_its_part_tagged_with_the_global_batch(kind):
    """Over 2 ranks, with look-ahead: disjoint parts of each global batch, the short last
    one (13 = 4 + 4 + 4 + 1) too, each tagged with the records of the whole batch."""
    args = dict(batch_size=4, shuffle=True, passes=1)
    whole = [f for f in _run(MAKERS[kind](**args), 5)]
    ranks = [MAKERS[kind](rank=k, world=2, **args) for k in (0, 1)]
    for step in range(5):
        parts = [r.read() for r in ranks]
        if step == 4:
            assert [p[-1] for p in parts] == [True, True]
            continue
        got = [torch.cat([p[i] for p in parts]).tolist() for i in range(2)]
        assert [got] == whole[step][0]
        records = 1 if step == 3 else 4
        assert [global_records(p[1]) for p in parts] == [records, records]
        assert [len(p[1]) for p in parts] == ([1, 0] if step == 3 else [2, 2])


@pytest.mark.parametrize("threaded", [False, True])
def test_a_stream_read_by_workers_looks_ahead_to_its_end(threaded):
    r = _reader(Stream(), batch_size=3, passes=2, num_workers=2)
    r._threaded = threaded
    # 2 workers batch their own parts: [0, 2, 4], [1, 3, 5], [6, 8], [7, 9]
    assert _reads(r, 4)[-1][0] == [7, 9]  # the stream's last batch: its end is prepared next
    assert r._ahead is not None and r.state_dict()["batches"] == 4
    assert _reads(r, 2)[0] == "done" and r.state_dict() == {"pass": 1, "batches": 1, "seed": r.seed, "fields": 2}
    parts = [_reader(Stream(), rank=k, world=2, batch_size=3, num_workers=2) for k in (0, 1)]
    for step in range(4):
        got = [read_op(None, p) for p in parts]
        assert [global_records(g[1]) for g in got] == [[3, 3, 2, 2][step]] * 2
    state = parts[0].state_dict()
    again = _reader(Stream(), rank=0, world=2, batch_size=3, num_workers=2)
    again.load_state_dict(state)
    assert _reads(again, 1) == _reads(parts[0], 1) == ["done"]


def test_without_workers_a_dataset_is_read_when_read_runs():
    """num_workers 0: the dataset draws from the job's random streams, so it is not read
    ahead: a draw between two reads (a step's dropout, say) comes before the next
    batch's transforms, as it does without look-ahead."""
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    ds = Noisy(12)
    first = [ds[i][0].tolist() for i in range(4)]
    between = torch.rand(3)
    second = [ds[i][0].tolist() for i in range(4, 8)]

    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    r = _reader(Noisy(12), batch_size=4)
    noise, _, _ = read_op(None, r)
    assert r._ahead is None
    assert torch.equal(torch.rand(3), between)
    noise2, _, _ = read_op(None, r)
    assert [noise.tolist(), noise2.tolist()] == [first, second]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failure_preparing_a_batch_is_raised_by_the_read_that_hands_it_out(threaded):
    r = _reader(Noisy(fail_at=5), batch_size=4, num_workers=2)
    r._threaded = threaded
    noise, index, done = read_op(None, r)  # batch 2 (samples 4-7) fails while prepared
    assert index.tolist() == [0, 1, 2, 3] and r.state_dict()["position"] == 4
    with pytest.raises(RunError, match=r"dataset Noisy: sample 5: ValueError: bad pixel"):
        read_op(None, r)
    assert r.state_dict()["position"] == 4  # the failed batch is still the next one


def test_random_windows_draw_from_the_nodes_generator_when_read_runs():
    """The next batch is prepared from a copy of the node's generator; the generator
    itself draws at `read`, so a checkpoint between reads holds its state after the
    batch handed out, and a draw by something else between reads is honoured."""
    ctx = OpContext(seed=3)
    r = reader_op(ctx, TOKENS, window=8, sample="random", batch_size=4)
    gen = torch.Generator()
    gen.set_state(ctx.generator.get_state())

    def expected() -> torch.Tensor:
        ix = torch.randint(len(TOKENS) - 8, (4,), generator=gen)
        return torch.stack([TOKENS[i:i + 8] for i in ix])

    assert torch.equal(r.read()[0], expected())
    assert r._ahead is not None and torch.equal(ctx.generator.get_state(), gen.get_state())
    prepared = r._ahead
    x = r.read()[0]
    assert x is prepared[0] and torch.equal(x, expected())  # the prepared batch, handed out
    torch.randint(10, (3,), generator=ctx.generator), torch.randint(10, (3,), generator=gen)
    assert torch.equal(r.read()[0], expected())  # drawn again: the prepared one was stale


def test_batches_going_to_a_gpu_are_prepared_on_the_look_aheads_thread(monkeypatch):
    """On the look-ahead's thread, in order: the gather (and the copy's start) of batch k+1
    overlaps the launches of step k, which the calling thread goes on with."""
    r = MAKERS["tensors general, threaded"](batch_size=4, shuffle=True, passes=1)
    plain = MAKERS["tensors general"](batch_size=4, shuffle=True, passes=1)
    assert not plain._threaded and not reader_op(OpContext(device="cpu"), TOKENS[:20])._threaded
    where = []
    take = r._take
    monkeypatch.setattr(r, "_take", lambda *a: where.append(threading.current_thread().name) or take(*a))
    got = [_batch(r.read()) for _ in range(5)]
    assert got == [_batch(plain.read()) for _ in range(5)]
    # the pass's first batch is taken by the read; the next three, ahead on the thread
    assert where[0] == threading.current_thread().name and len(where) == 4
    assert all(name.startswith("jobrun-look-ahead") for name in where[1:]), where


# -- in a job: checkpoints taken while batches are prepared ----------------------------

JOB = """
job: ahead
seed: 2
max_epochs: 3
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 20, features: 3, classes: 2}
      - build: {in: [x, y], out: ds, target: torch.utils.data.TensorDataset}
      - reader: {in: [x, y], out: t, batch_size: 4, shuffle: true, passes: 0}
      - reader: {in: ds, out: d, batch_size: 4, shuffle: true, passes: 0, num_workers: 1}
      - fill: {out: acc, shape: [4, 3], value: 0.0}
epoch:
  - task: train
    do:
      # 3 reads of a pass of 5 batches: every epoch ends with the next batch prepared
      - loop: 3
        do:
          - read: {in: t, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: t, out: [xb, yb, end]}}]
          - read: {in: d, out: [xd, yd, dend]}
          - if: dend
            then: [{read: {in: d, out: [xd, yd, dend]}}]
          - mul: {in: [acc, 1.5], out: acc}  # the order of the batches shows in the sum
          - add: {in: [acc, xb], out: acc}
          - add: {in: [acc, xd], out: acc}
"""


def test_a_job_resumed_from_checkpoints_taken_while_batches_are_prepared_is_bit_exact(tmp_path):
    import shutil

    from runner_util import ckpt_values, jobrun

    (tmp_path / "plan.yaml").write_text(JOB)
    ref = tmp_path / "ref"
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", ref)
    assert r.code == 0, r.text
    want = ckpt_values(ref, 3)
    assert want["acc"] != ckpt_values(ref, 2)["acc"]
    for epoch in (1, 2):
        run = tmp_path / f"from{epoch}"
        shutil.copytree(ref, run)
        r = jobrun("resume", "--run-dir", run, "--epoch", str(epoch))
        assert r.code == 0, r.text
        assert ckpt_values(run, 3) == want, f"resumed from epoch {epoch}"


# -- on a CUDA GPU (skipped without one; benchmarks/gpu.sh runs them) -------------------

def _cuda(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def _readers_on(device: str) -> dict:
    """A reader of each kind that looks ahead, over the same records, on `device`."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g)
    tokens = torch.arange(1000) * 7 % 65
    return {
        "tensors": reader_op(OpContext(device=device), x, y, batch_size=8, shuffle=True),
        "dataset": reader_op(OpContext(device=device), TensorDataset(x, y), batch_size=8, shuffle=True,
                             num_workers=1),
        "windows": reader_op(OpContext(device=device), tokens, window=16, sample="random", batch_size=8),
    }


@_cuda
def test_the_next_batch_is_on_the_gpu_before_the_next_read():
    """When a read hands out batch k, batch k+1 is prepared on the reader's thread, its
    copy issued on the reader's side stream: after a device sync, and no other read, it is
    on the GPU."""
    from jobrun.ops.transfer import _Sent

    on_cpu, on_gpu = _readers_on("cpu"), _readers_on("cuda")
    for kind, reader in on_gpu.items():
        read_op(None, reader)
        assert reader._threaded and isinstance(reader._ahead, Future), kind  # on the reader's thread
        expected = read_op(None, on_cpu[kind]), read_op(None, on_cpu[kind])
        sent = _ahead(reader)
        assert isinstance(sent, _Sent), kind
        assert all(t.is_cuda for t in sent.fields), kind
        torch.cuda.synchronize()
        assert sent.event.query(), kind  # the copies ran without another read
        assert all(torch.equal(t.cpu(), e) for t, e in zip(sent.fields, expected[1][:2])), kind
        got = read_op(None, reader)
        assert all(a is b for a, b in zip(got[:2], sent.fields)), kind  # handed out as sent
        getattr(reader, "close", lambda: None)()


@_cuda
def test_steady_state_reads_of_every_reader_never_wait_for_the_device():
    """Pinned memory, non_blocking copies on a side stream, the wait on the device: no
    read synchronises with the device (random windows were copied blocking once)."""
    for kind, reader in _readers_on("cuda").items():
        for step in range(5):
            if step >= 2:  # after the first reads (CUDA set up, pinned memory cached)
                torch.cuda.set_sync_debug_mode("error")
            try:
                xb, yb, done = read_op(None, reader)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert xb.is_cuda and yb.is_cuda and not done, kind
        getattr(reader, "close", lambda: None)()


def test_a_shuffled_tensor_batch_is_gathered_by_index_like_indexing():
    """`ToDevice.gather` (what a tensor reader gathers a shuffled batch with, off the plain
    path): the records of `x[idx]`, in a tensor of its own; on the CPU nothing is pinned."""
    from jobrun.ops.transfer import ToDevice

    x, idx = torch.randn(10, 3, 2), torch.tensor([7, 0, 3])
    got = ToDevice("cpu").gather(x, idx)
    assert torch.equal(got, x[idx]) and got.is_contiguous() and got.data_ptr() != x.data_ptr()
    assert torch.equal(ToDevice("cpu").gather(x[:, 1], idx), x[idx, 1])  # a strided view too


@_cuda
def test_a_tensor_batch_is_gathered_straight_into_pinned_memory(monkeypatch):
    """One copy of a batch on the host: gathered into pinned memory, not gathered and then
    pinned (`Tensor.pin_memory` is never called), and the batches are the CPU reader's."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
    on_cpu = reader_op(OpContext(device="cpu"), x, y, batch_size=16, shuffle=True, passes=0)
    on_gpu = reader_op(OpContext(device="cuda"), x, y, batch_size=16, shuffle=True, passes=0)
    pins = []
    real = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: pins.append(t.shape) or real(t, *a))
    for _ in range(6):  # across a pass's end (`done` left out: the next pass starts)
        a, b = read_op(None, on_cpu, ("x", "y")), read_op(None, on_gpu, ("x", "y"))
        assert b[0].is_cuda and torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())
    assert pins == []
    from jobrun.ops.transfer import ToDevice

    gathered = ToDevice("cuda").gather(x, torch.tensor([5, 1]))
    assert gathered.is_pinned() and torch.equal(gathered, x[[5, 1]])


def test_a_mapping_batch_that_is_no_dict_is_moved_as_a_dict_is():
    # Hugging Face's tokenizers give a BatchEncoding, a UserDict: it was left on the host
    # (train.step moved it later, blocking); the meta device stands in for a GPU here.
    from collections import UserDict

    from jobrun.ops.transfer import ToDevice

    ids, mask = torch.arange(6).view(2, 3), torch.ones(2, 3)
    for batch in ({"input_ids": ids, "mask": mask}, UserDict(input_ids=ids, mask=mask)):
        (moved,) = ToDevice("meta")((batch,))
        assert dict(moved).keys() == {"input_ids", "mask"}
        assert all(t.is_meta and t.shape == (2, 3) for t in moved.values()), type(batch)
