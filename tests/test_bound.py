"""Ops bound to a call site (jobrun/ops/bound.py): `train.step` and `read` specialised to
their arguments give what the op's function gives, bit for bit, for every input; call
sites that are not the plain case stay unbound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jobrun.errors import RunError
from jobrun.ops import bound, train
from jobrun.ops.context import OpContext
from jobrun.ops.reader import read_op, reader_op
from jobrun.runner.throughput import Feed


def _model_and_opt(seed: int = 0, out: int = 3, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, out)).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches(kind: str, n: int = 4):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(6, 4, generator=g)
        if kind == "mse":
            yield x, torch.randn(6, 3, generator=g)
        elif kind == "float labels":  # class indices stored as floats: the wrapper's path
            yield x, torch.randint(0, 3, (6,), generator=g).float()
        elif kind == "float64":
            yield x.double(), torch.randint(0, 3, (6,), generator=g)
        else:
            yield x, torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("kind", ["cross_entropy", "mse", "float labels", "float64"])
def test_a_bound_step_trains_as_train_step_bit_for_bit(kind: str) -> None:
    loss = "mse" if kind == "mse" else "cross_entropy"
    dtype = torch.float64 if kind == "float64" else torch.float32
    ctx = OpContext(device="cpu")
    step = bound.bind_step(ctx, loss=loss)
    assert step is not None
    (m1, o1), (m2, o2) = _model_and_opt(dtype=dtype), _model_and_opt(dtype=dtype)
    for x, y in _batches(kind):
        a = train.train_step(ctx, m1, o1, x, y, loss=loss)
        b = step(m2, o2, x, y)
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_inputs_outside_the_plain_case_get_train_steps_answers() -> None:
    ctx = OpContext(device="cpu")
    step = bound.bind_step(ctx)
    model, opt = _model_and_opt()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    for args, expected in [
        ((model, "not an optimizer", x, y), "optimizer"),
        ((model, opt, None, y), "null"),  # a read past its pass's end
        ((model, opt, x[:0], y[:0]), "empty"),
    ]:
        with pytest.raises(RunError) as bound_error:
            step(*args)
        with pytest.raises(RunError) as op_error:
            train.train_step(ctx, *args)
        assert expected in bound_error.value.message
        assert bound_error.value.message == op_error.value.message
    # numpy inputs are made tensors by train_step, as before
    (m1, o1), (m2, o2) = _model_and_opt(), _model_and_opt()
    assert torch.equal(train.train_step(ctx, m1, o1, x.numpy(), y.numpy()), step(m2, o2, x.numpy(), y.numpy()))


@pytest.mark.parametrize("args", [
    {"amp": "bf16"}, {"accumulate": 2}, {"clip_grad_norm": 1.0}, {"loss": "model"},
    {"loss": "torch.nn.functional:l1_loss"}, {"accumulate": 1.0},
])
def test_call_sites_outside_the_plain_case_are_not_bound(args: dict) -> None:
    assert bound.bind_step(OpContext(device="cpu"), **args) is None


def test_replicas_are_not_bound() -> None:
    assert bound.bind_step(OpContext(device="cpu", world_size=2, rank=0)) is None


def _feed_ctx() -> OpContext:
    return OpContext(device="cpu", progress={"feed": Feed()})


def test_a_bound_read_reads_and_counts_as_read_op() -> None:
    names = ("xb", "yb", "end")
    ours, theirs = _feed_ctx(), _feed_ctx()
    read = bound.bind_read(ours, names)
    assert read is not None
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    r1 = reader_op(ours, x, y, batch_size=2, shuffle=True, passes=2)
    r2 = reader_op(theirs, x, y, batch_size=2, shuffle=True, passes=2)
    for _ in range(8):  # two passes and their ends, then past the last
        a, b = read(r1), read_op(theirs, r2, names)
        assert len(a) == len(b) == 3 and a[2] == b[2]
        assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(a[:2], b[:2]))
    assert r1.tally[:2] == r2.tally[:2] and r1.tally[2] > 0  # records, tokens; the wait was timed
    assert ours.progress["feed"].snapshot()[0] == theirs.progress["feed"].snapshot()[0]


def test_a_read_without_done_or_of_another_reader_goes_through_read_op() -> None:
    ctx = _feed_ctx()
    x = torch.arange(6.0)
    assert bound.bind_read(ctx, ("xb",)) is None  # one output: the reader's one field
    rolled = bound.bind_read(ctx, ("xb", "yb"))  # done left out: the next pass goes on
    r = reader_op(ctx, x, -x, batch_size=4, passes=0)
    assert [rolled(r)[1].tolist() for _ in range(3)] == [[-0.0, -1.0, -2.0, -3.0], [-4.0, -5.0], [-0.0, -1.0, -2.0, -3.0]]
    with pytest.raises(RunError, match="read expects a reader"):
        bound.bind_read(ctx, ("xb", "end"))("not a reader")
    # The generated line does not count a bound read's values: the fallback does.
    three = reader_op(ctx, x, x, x, batch_size=4, keys=["a", "b", "c"])  # one dict a batch
    with pytest.raises(RunError, match=r"the reader gives 1 field\(s\) a batch, then `done`, and `out` names 3"):
        bound.bind_read(ctx, ("a", "b", "end"))(three)
    # Two fields read into [xb, end] with a stop_if testing `end`: not a roll-over read.
    with pytest.raises(RunError, match=r"and `out` names 1 before `end`: `end` gets field 2, though a `stop_if`"):
        bound.bind_read(ctx, ("xb", "end"), _done_tested=True)(r)
    assert bound.bind_read(OpContext(device="cpu"), ("xb", "end")) is None  # no run: no feed to count in


def test_the_code_generator_calls_the_bound_ops(tmp_path) -> None:
    """A plan's train.step and read run bound: the generated source calls them with the
    inputs only (tracebacks and failures still name the plan's line)."""
    import linecache

    from runner_util import jobrun

    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "job: b\nmax_epochs: 1\ninit:\n  - task: s\n    do:\n"
        "      - data.synthetic: {out: [x, y], task: classification, n: 32, features: 4, classes: 2}\n"
        "      - reader: {in: [x, y], out: data, batch_size: 8, passes: 0}\n"
        "      - model.mlp: {out: model, sizes: [4, 2]}\n      - optimizer: {in: model, out: opt, lr: 0.1}\n"
        "epoch:\n  - task: train\n    do:\n      - loop: null\n        do:\n"
        "          - read: {in: data, out: [xb, yb, end]}\n          - stop_if: end\n"
        "          - train.step: {in: [model, opt, xb, yb], out: loss}\n    outputs: [loss]\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    source = "".join(line for name, entry in linecache.cache.items() if "task 'train'" in str(name)
                     for line in entry[2])
    assert "_read(G['data'])" in source and "_train_step(G['model'], G['opt'], L['xb'], L['yb'])" in source, source
    assert "results(r, 3)" not in source, source  # the bound read counts its values itself
