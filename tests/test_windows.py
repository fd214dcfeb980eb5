"""Token streams: raw `.bin` files memory-mapped by `data.load`, a reader of windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jobrun.errors import RunError
from jobrun.ops.context import OpContext
from jobrun.ops.data import data_load
from jobrun.ops.reader import read_op, reader_op

TOKENS = torch.arange(1000, dtype=torch.int64) * 7 % 65  # a stream of 1000 tokens


def _ctx(rank: int = 0, world: int = 1, tmp=None) -> OpContext:
    return OpContext(rank=rank, world_size=world, plan_dir=tmp) if tmp else OpContext(rank=rank, world_size=world)


# -- data.load ------------------------------------------------------------------------


def test_a_bin_file_is_a_memory_mapped_stream_of_its_dtype(tmp_path):
    data = (np.arange(5000) % 300).astype(np.uint16)
    data.tofile(tmp_path / "train.bin")
    t = data_load(_ctx(tmp=tmp_path), path="train.bin", dtype="uint16")
    assert t.dtype == torch.uint16 and t.shape == (5000,)
    assert torch.equal(t.to(torch.int64), torch.from_numpy(data.astype(np.int64)))
    t[0] = 299  # copy-on-write: the file keeps its bytes
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16)[0] == 0
    copied = data_load(_ctx(tmp=tmp_path), path="train.bin", dtype="uint16", mmap=False)
    assert torch.equal(copied.to(torch.int64), torch.from_numpy(data.astype(np.int64)))


def test_a_large_npy_file_is_memory_mapped(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.int32))
    mapped = data_load(_ctx(tmp=tmp_path), path="a.npy", mmap=True)
    assert mapped.tolist() == list(range(10))
    mapped[0] = 5  # copy-on-write
    assert np.load(tmp_path / "a.npy")[0] == 0


@pytest.mark.parametrize("name, kwargs, message", [
    ("t.bin", {}, "a .bin file is raw and needs its `dtype`"),
    ("t.bin", {"dtype": "uint24"}, "unknown dtype 'uint24'"),
    ("t.npy", {"dtype": "uint16"}, "`dtype` applies to raw .bin files only"),
    ("odd.bin", {"dtype": "uint16"}, "has 3 bytes, not a whole number of uint16 values"),
    ("t.csv", {"mmap": True}, "only .bin and .npy files can be memory-mapped"),
])
def test_bad_token_files_are_one_message(tmp_path, name, kwargs, message):
    (tmp_path / "t.bin").write_bytes(b"\0\0")
    (tmp_path / "odd.bin").write_bytes(b"\0\0\0")
    np.save(tmp_path / "t.npy", np.zeros(2))
    (tmp_path / "t.csv").write_text("1\n")
    with pytest.raises(RunError, match=message.replace("(", r"\(").replace(")", r"\)")):
        data_load(_ctx(tmp=tmp_path), path=name, **kwargs)


# -- the reader of windows -----------------------------------------------------------


def test_random_windows_are_nanogpts_get_batch_from_the_nodes_generator():
    ctx = _ctx()
    r = reader_op(ctx, TOKENS, window=8, sample="random", batch_size=4)
    gen = torch.Generator().manual_seed(0)
    gen.set_state(ctx.generator.get_state())
    for _ in range(3):
        x, y, done = read_op(ctx, r)
        ix = torch.randint(len(TOKENS) - 8, (4,), generator=gen)  # nanoGPT's get_batch
        assert torch.equal(x, torch.stack([TOKENS[i:i + 8] for i in ix]))
        assert torch.equal(y, torch.stack([TOKENS[i + 1:i + 9] for i in ix]))
        assert x.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous() and done is False


def test_ranks_read_disjoint_slices_of_the_same_global_batches():
    whole = reader_op(_ctx(), TOKENS, window=8, sample="random", batch_size=6)
    parts = [reader_op(_ctx(rank, 2), TOKENS, window=8, sample="random", batch_size=6) for rank in (0, 1)]
    for _ in range(3):
        x, y, _ = whole.read()
        pieces = [p.read() for p in parts]
        assert [len(p[0]) for p in pieces] == [3, 3]
        assert torch.equal(torch.cat([p[0] for p in pieces]), x)
        assert torch.equal(torch.cat([p[1] for p in pieces]), y)


def test_windows_in_order_walk_passes_and_split_over_ranks():
    r = reader_op(_ctx(), TOKENS[:41], window=8, batch_size=2)  # 5 windows: 0, 8, ..., 32
    batches = []
    while True:
        x, y, done = r.read()
        if done:
            break
        batches.append(x[:, 0].tolist())
    assert batches == [[TOKENS[0], TOKENS[8]], [TOKENS[16], TOKENS[24]], [TOKENS[32]]]
    assert [x.tolist() for x, _ in r.full_pass()] == [x.tolist() for x, _ in
                                                     reader_op(_ctx(), TOKENS[:41], window=8, batch_size=2).full_pass()]
    halves = [reader_op(_ctx(k, 2), TOKENS[:41], window=8, batch_size=2, shuffle=True) for k in (0, 1)]
    whole = reader_op(_ctx(), TOKENS[:41], window=8, batch_size=2, shuffle=True)
    for _ in range(3):
        assert torch.equal(torch.cat([h.read()[0] for h in halves]), whole.read()[0])


def test_the_position_and_the_generator_resume_exactly():
    ctx = _ctx()
    r = reader_op(ctx, TOKENS, window=8, sample="random", batch_size=4)
    r.read()
    state, gen = r.state_dict(), ctx.generator.get_state()
    expected = [r.read()[0] for _ in range(3)]
    ctx2 = _ctx()
    again = reader_op(ctx2, TOKENS, window=8, sample="random", batch_size=4)
    again.load_state_dict(state)
    ctx2.generator.set_state(gen)
    assert all(torch.equal(again.read()[0], e) for e in expected)


@pytest.mark.parametrize("fields, kwargs, message", [
    ((TOKENS,), {"sample": "random"}, "sample applies to a reader of windows"),
    ((TOKENS, TOKENS), {"window": 4}, "reads one token stream, got 2 inputs"),
    ((TOKENS.reshape(10, 100),), {"window": 4}, "a 1-D stream of integer tokens, got a 2-D"),
    ((TOKENS.float(),), {"window": 4}, "a 1-D stream of integer tokens"),
    ((TOKENS[:4],), {"window": 4}, "the stream has 4 tokens, too few"),
    ((TOKENS,), {"window": 0}, "window must be a whole number"),
])
def test_bad_window_readers_are_one_message(fields, kwargs, message):
    with pytest.raises(RunError, match=message):
        reader_op(_ctx(), *fields, **kwargs)


def test_random_windows_have_no_pass_to_evaluate_over():
    r = reader_op(_ctx(), TOKENS, window=8, sample="random", batch_size=4)
    with pytest.raises(RunError, match="no pass to evaluate over"):
        next(r.full_pass())
