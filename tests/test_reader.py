"""The `reader`/`read` ops: pass and done semantics, rank slices, shuffle, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jobrun.errors import RunError
from jobrun.ops.context import OpContext
from jobrun.ops.reader import Reader, read_op, reader_op
from jobrun.ops.tensor_reader import TensorReader


def _drain(ctx: OpContext, reader: Reader, reads: int) -> list:
    """`reads` calls of `read`: a batch's first field as a list, or "done"."""
    out = []
    for _ in range(reads):
        *fields, done = read_op(ctx, reader)
        if done:
            assert all(f is None for f in fields)
            out.append("done")
        else:
            first = fields[0]
            out.append(first.tolist() if isinstance(first, torch.Tensor) else first)
    return out


def _epoch_batches(ctx: OpContext, reader: Reader) -> list[list[int]]:
    """The batches of one pass, up to (and consuming) its `done`."""
    batches = []
    while True:
        *fields, done = read_op(ctx, reader)
        if done:
            return batches
        batches.append(fields[0].tolist())


def test_done_once_per_pass_then_stays_true_after_the_last():
    ctx = OpContext()
    r = reader_op(ctx, torch.arange(5), batch_size=2, passes=2)
    assert _drain(ctx, r, 10) == [
        [0, 1], [2, 3], [4], "done",
        [0, 1], [2, 3], [4], "done",
        "done", "done",
    ]  # fmt: skip


@pytest.mark.parametrize("window", [None, 4])
def test_a_reader_whose_pass_has_no_batch_is_refused(window):
    # drop_last with fewer records than a batch: every read was `done`, so a `passes: 0`
    # loop ended at once each epoch (analyze counts on a first batch in every pass).
    data = torch.arange(13 if window else 3)  # 3 records either way: 3 windows of 4
    with pytest.raises(RunError, match="drop_last drops all 3 records, fewer than batch_size 4") as e:
        reader_op(OpContext(), data, batch_size=4, drop_last=True, passes=0, window=window)
    assert "a batch_size of at most 3" in e.value.hint
    made = [reader_op(OpContext(), data, batch_size=3, drop_last=True, passes=0, window=window)]
    if window:  # random windows have no pass: drop_last does nothing to them
        made.append(reader_op(OpContext(), data, batch_size=4, drop_last=True, window=window, sample="random"))
    assert [read_op(OpContext(), r)[-1] for r in made] == [False] * len(made)


def test_drop_last_skips_the_short_batch():
    ctx = OpContext()
    r = reader_op(ctx, torch.arange(5), batch_size=2, drop_last=True)
    assert _drain(ctx, r, 4) == [[0, 1], [2, 3], "done", "done"]
    assert r.batches_per_pass == 2


def test_passes_zero_reads_forever_with_done_once_per_pass():
    ctx = OpContext()
    r = reader_op(ctx, torch.arange(3), batch_size=2, passes=0)
    assert _drain(ctx, r, 30) == [[0, 1], [2], "done"] * 10


def test_without_done_in_out_a_read_goes_on_into_the_next_pass():
    """`read: {out: [x]}` (no `done`): the read that meets a pass's end starts the next
    pass, so a `passes: 0` reader never gives null fields; after the last pass it does."""
    ctx = OpContext()
    forever = reader_op(ctx, torch.arange(3), batch_size=2, passes=0)
    got = [read_op(ctx, forever, ("x",)).tolist() for _ in range(7)]  # one out: the field itself
    assert got == [[0, 1], [2], [0, 1], [2], [0, 1], [2], [0, 1]]
    twice = reader_op(ctx, torch.arange(3), batch_size=2, passes=2)
    got = [read_op(ctx, twice, ("x",)) for _ in range(6)]
    assert [g.tolist() for g in got[:4]] == [[0, 1], [2], [0, 1], [2]] and got[4:] == [None, None]
    # the position moves as reads with `done` move it: the same state after the same batches
    ref = reader_op(ctx, torch.arange(3), batch_size=2, passes=0)
    _drain(ctx, ref, 3 * 3 + 1)  # three passes with their `done`, and one batch
    assert (ref.pass_index, ref.position) == (forever.pass_index, forever.position) == (3, 2)


def test_batch_size_one_gives_unbatched_records_of_every_field_type():
    ctx = OpContext()
    x = torch.arange(6).reshape(3, 2)
    r = reader_op(ctx, x, np.array([7, 8, 9]), ["a", "b", "c"])
    xb, yb, name, done = read_op(ctx, r)
    assert xb.tolist() == [0, 1] and int(yb) == 7 and name == "a" and done is False
    assert _drain(ctx, r, 3) == [[2, 3], [4, 5], "done"]


def test_numpy_and_list_fields_batch_with_their_own_type():
    ctx = OpContext()
    r = reader_op(ctx, np.arange(4), ["a", "b", "c", "d"], batch_size=3, shuffle=True)
    arr, names, done = read_op(ctx, r)
    assert isinstance(arr, np.ndarray) and isinstance(names, list)
    assert [("abcd"[i]) for i in arr] == names and not done


def test_an_empty_reader_is_refused_as_an_empty_dataset_is():
    # It was done at once: a training loop over it ran no step, and the job "finished"
    # with loss=0 and exit 0 (an empty Dataset or stream was an error already).
    with pytest.raises(RunError, match="reader inputs have no records") as e:
        reader_op(OpContext(), torch.zeros(0, 3), batch_size=4, passes=2)
    assert "an empty file" in e.value.hint


@pytest.mark.parametrize(
    ("n", "batch_size", "shuffle"),
    [(12, 4, False), (7, 3, False), (9, 5, True), (5, 4, True)],
)
def test_rank_slices_concatenate_to_the_single_process_batches(n, batch_size, shuffle):
    data = torch.arange(n)
    single = OpContext(seed=3)
    r1 = reader_op(single, data, batch_size=batch_size, shuffle=shuffle, passes=2)
    ranks = [OpContext(seed=3, rank=k, world_size=2) for k in range(2)]
    readers = [reader_op(c, data, batch_size=batch_size, shuffle=shuffle, passes=2) for c in ranks]
    for _ in range(2):
        expected = _epoch_batches(single, r1)
        parts = [_epoch_batches(c, r) for c, r in zip(ranks, readers)]
        assert [a + b for a, b in zip(*parts)] == expected
        # tensor_split: the lower rank never gets fewer records.
        assert all(len(a) >= len(b) for a, b in zip(*parts))
    # A global batch of one record leaves rank 1 an empty slice.
    if n % batch_size == 1:
        assert parts[1][-1] == []


@pytest.mark.parametrize("shuffle", [False, True])
def test_batch_rows_names_the_rows_of_the_global_batch_each_rank_read(monkeypatch, shuffle):
    # jobrun.batch_rows, for a call's own randomness: drawn for the whole global batch and
    # cut to `rows`, rank k's part is what one process draws for those records.
    import torch.distributed as dist

    from jobrun import batch_rows

    data = torch.arange(10)
    single = reader_op(OpContext(seed=3), data, batch_size=4, shuffle=shuffle)
    ranks = [OpContext(seed=3, rank=k, world_size=2) for k in range(2)]
    readers = [reader_op(c, data, batch_size=4, shuffle=shuffle) for c in ranks]
    for _ in range(3):  # 4 + 4 + 2 records: the last global batch splits 1 + 1
        (whole, _), parts = read_op(OpContext(seed=3), single), []
        for k, (ctx, reader) in enumerate(zip(ranks, readers)):
            monkeypatch.setattr(dist, "get_rank", lambda k=k: k)
            monkeypatch.setattr(dist, "get_world_size", lambda: 2)
            part, _ = read_op(ctx, reader)
            total, rows = batch_rows(part)
            assert total == len(whole) and torch.equal(whole[rows], part)
            parts.append(rows)
        assert parts[0].stop == parts[1].start and parts[1].stop == len(whole)
    with pytest.raises(ValueError, match="a batch of 1 rows is not this replica's part"):
        batch_rows(_marked(torch.zeros(1), 4))  # rank 1 of 2 holds 2 rows of a batch of 4
    plain = torch.zeros(3)  # no reader split it (one process, or computed): all its rows
    assert batch_rows(plain) == (3, slice(0, 3))


def _marked(t, records):
    from jobrun.ops.split import mark_records

    mark_records((t,), records)
    return t


def test_batch_size_one_is_replicated_on_every_rank():
    ranks = [OpContext(rank=k, world_size=2) for k in range(2)]
    readers = [reader_op(c, torch.arange(3)) for c in ranks]
    assert _drain(ranks[0], readers[0], 4) == _drain(ranks[1], readers[1], 4)


def test_shuffle_is_a_seeded_permutation_per_pass():
    def first_two_passes(ctx: OpContext, ordinal_skip: int = 0) -> list[list[int]]:
        for _ in range(ordinal_skip):
            reader_op(ctx, torch.arange(2))
        r = reader_op(ctx, torch.arange(20), batch_size=20, shuffle=True, passes=2)
        return [_epoch_batches(ctx, r)[0] for _ in range(2)]

    a = first_two_passes(OpContext(seed=1))
    assert a == first_two_passes(OpContext(seed=1))
    assert sorted(a[0]) == list(range(20)) and a[0] != a[1]
    assert a != first_two_passes(OpContext(seed=2))
    assert a != first_two_passes(OpContext(seed=1, node="other"))
    assert a != first_two_passes(OpContext(seed=1), ordinal_skip=1)


def test_a_resumed_node_numbers_its_next_reader_as_the_first_run_did():
    """Readers made by epoch tasks are numbered per node; the number is part of the
    context's state, which checkpoints carry, so a resumed run shuffles the same way."""
    ctx = OpContext(seed=1)
    reader_op(ctx, torch.arange(8))  # the node's first reader
    saved = ctx.state()
    second = reader_op(ctx, torch.arange(20), batch_size=20, shuffle=True)
    resumed = OpContext(seed=1)
    resumed.load_state(saved)
    again = reader_op(resumed, torch.arange(20), batch_size=20, shuffle=True)
    assert _epoch_batches(resumed, again) == _epoch_batches(ctx, second)
    assert ctx.state() == resumed.state() != saved  # both counted the second reader


def test_state_dict_round_trip_resumes_the_same_sequence():
    data = torch.arange(11)
    ctx = OpContext(seed=5)
    r = reader_op(ctx, data, batch_size=3, shuffle=True, passes=3)
    _drain(ctx, r, 6)  # into the second pass
    state = r.state_dict()
    assert set(state) == {"pass", "position", "seed", "length"}
    assert all(type(v) is int for v in state.values())
    expected = _drain(ctx, r, 12)

    fresh_ctx = OpContext(seed=99)  # a different seed: the state must carry the order
    resumed = reader_op(fresh_ctx, data, batch_size=3, shuffle=True, passes=3)
    resumed.load_state_dict(state)
    assert _drain(fresh_ctx, resumed, 12) == expected


def test_load_state_dict_refuses_changed_data():
    ctx = OpContext()
    state = reader_op(ctx, torch.arange(10), batch_size=2).state_dict()
    with pytest.raises(RunError, match="data changed.*10 records.*now has 8"):
        reader_op(ctx, torch.arange(8), batch_size=2).load_state_dict(state)
    with pytest.raises(RunError, match="missing"):
        reader_op(ctx, torch.arange(10)).load_state_dict({"pass": 0})


def test_full_pass_is_unshuffled_and_leaves_the_position_alone():
    ranks = [OpContext(rank=k, world_size=2) for k in range(2)]
    readers = [reader_op(c, torch.arange(7), batch_size=3, shuffle=True) for c in ranks]
    read_op(ranks[0], readers[0])
    before = readers[0].state_dict()
    batches = [[x.tolist() for (x,) in r.full_pass()] for r in readers]
    assert batches == [[[0, 1], [3, 4], [6]], [[2], [5], []]]
    assert readers[0].state_dict() == before


def test_bad_inputs_are_clear_errors():
    ctx = OpContext()
    with pytest.raises(RunError, match="different lengths"):
        reader_op(ctx, torch.arange(3), torch.arange(4))
    with pytest.raises(RunError, match="batch_size"):
        reader_op(ctx, torch.arange(3), batch_size=0)
    with pytest.raises(RunError, match="scalar"):
        reader_op(ctx, torch.tensor(1.0))
    with pytest.raises(RunError, match="expects a reader"):
        read_op(ctx, torch.arange(3))


def _batches_and_states(reader: Reader, reads: int) -> list:
    """Each read's fields (values, dtype, shape, strides) and the state after it."""
    out = []
    for _ in range(reads):
        *fields, done = reader.read()
        shown = [
            None if f is None else (f.tolist(), f.dtype, tuple(f.shape), f.stride())
            for f in fields
        ]
        out.append((shown, done, reader.state_dict()))
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n_fields", [1, 2, 3])
@pytest.mark.parametrize(("batch_size", "drop_last", "passes"), [(4, False, 2), (3, True, 0)])
def test_plain_readers_read_what_the_general_path_reads(
    shuffle, n_fields, batch_size, drop_last, passes
):
    """One process over CPU tensors takes a fast path (index_select, no rank slices):
    the same batches, layouts and checkpointed positions as the general path."""
    fields = [torch.arange(33).reshape(11, 3).float(), torch.arange(11), torch.arange(22).reshape(11, 2)]
    args = dict(batch_size=batch_size, shuffle=shuffle, passes=passes, drop_last=drop_last, seed=4)
    fast = TensorReader(fields[:n_fields], **args)
    general = TensorReader(fields[:n_fields], **args)
    general._plain = False
    assert fast._plain
    assert _batches_and_states(fast, 12) == _batches_and_states(general, 12)
    def passes_of(r: Reader) -> list:
        return [[(f.tolist(), f.stride()) for f in fields] for fields in r.full_pass()]

    assert passes_of(fast) == passes_of(general)


def test_only_one_process_over_contiguous_cpu_tensors_is_plain():
    x = torch.arange(12).reshape(6, 2)
    assert TensorReader([x], batch_size=2)._plain
    assert not TensorReader([x], batch_size=1)._plain  # single records are unbatched
    assert not TensorReader([x], batch_size=2, rank=0, world_size=2)._plain
    assert not TensorReader([x.t().contiguous().t()], batch_size=2)._plain  # not contiguous
    assert not TensorReader([x, np.arange(6)], batch_size=2)._plain
    assert not TensorReader([torch.nn.Parameter(x.float())], batch_size=2)._plain


def test_reader_order_gives_a_hand_loop_the_shuffled_readers_batches():
    """jobrun.reader_order (documented for hand loops): the record order of each pass of
    the N-th reader made on a node, for the plan's seed."""
    import jobrun

    ctx = OpContext(seed=3, node="n1")
    reader_op(ctx, torch.arange(7), batch_size=4)  # the node's reader 0 (not shuffled)
    shuffled = reader_op(ctx, torch.arange(10), batch_size=4, shuffle=True, passes=2)
    for pass_index in range(2):
        order = jobrun.reader_order(10, pass_index, seed=3, node="n1", reader=1).tolist()
        assert _epoch_batches(ctx, shuffled) == [order[0:4], order[4:8], order[8:10]]
    assert sorted(order) == list(range(10))
    assert jobrun.reader_order(10, 0, seed=3, node="n1", reader=1).tolist() != \
        jobrun.reader_order(10, 0, seed=4, node="n1", reader=1).tolist()


@pytest.mark.parametrize(("args", "named"), [
    ((10, -1), "pass_index is -1"),  # epoch - 1 of an epoch 0
    ((10.0, 0), "n is 10.0"),
    ((10, 0, 0.0), "seed is 0.0"),  # str(0.0) would mix another seed than the plan's 0
    ((10, 0, True), "seed is True"),
    ((10, torch.tensor(1.5)), r"pass_index is tensor\(1.5000\)"),  # torch's own TypeError
    ((torch.tensor([10, 3]), 0), r"n is tensor\(\[10,  3\]\)"),  # torch's own RuntimeError
    ((10, torch.tensor(True)), r"pass_index is tensor\(True\)"),  # taken for 1
])
def test_reader_order_refuses_what_is_no_whole_number_instead_of_giving_another_order(args, named):
    import jobrun

    with pytest.raises(ValueError, match=f"reader_order: {named}; give "):
        jobrun.reader_order(*args)
    assert jobrun.reader_order(np.int64(10), torch.tensor(1), np.int64(3)).tolist() == \
        jobrun.reader_order(10, 1, 3).tolist()  # numpy's and torch's integers are whole numbers
