"""`evaluate: {batches: N}`: the reader's next N batches, averaged as nanoGPT's
estimate_loss averages them (the float32 mean of the batch losses)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jobrun.errors import RunError
from jobrun.ops import train
from jobrun.ops.context import OpContext
from jobrun.ops.reader import read_op, reader_op
from jobrun.plans.compile import compile_text
from jobrun.plans.state import checkpointed


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 4, generator=g)
    y = torch.randint(0, 3, (50,), generator=g)
    return model, x, y


def test_n_batches_equal_a_hand_loops_estimate_bit_for_bit():
    model, x, y = _setup()
    ctx = OpContext()
    # two readers of the same order: each made first by a context of its own
    ours = reader_op(OpContext(), x, y, batch_size=8, shuffle=True, passes=0)
    theirs = reader_op(OpContext(), x, y, batch_size=8, shuffle=True, passes=0)
    for _ in range(3):  # twice over: the second estimate reads on, as get_batch does
        loss, acc = train.evaluate(ctx, model, ours, batches=10)
        model.eval()
        losses = torch.zeros(10)
        hits = total = 0
        k = 0
        with torch.no_grad():
            while k < 10:
                xb, yb, done = read_op(ctx, theirs)
                if done:
                    continue
                logits = model(xb)
                losses[k] = F.cross_entropy(logits, yb).item()
                hits += int((logits.argmax(-1) == yb).sum())
                total += len(yb)
                k += 1
        model.train()
        assert loss == losses.mean().item()
        assert acc == hits / total
        assert ours.state_dict() == theirs.state_dict()  # the same position afterwards
    # 50 records, 7 batches a pass (the last of 2): not a record-weighted mean
    assert ours.pass_index > 0


def test_a_finite_reader_that_runs_out_is_one_clear_error():
    model, x, y = _setup()
    ctx = OpContext()
    reader = reader_op(ctx, x, y, batch_size=25, passes=1)
    with pytest.raises(RunError, match="ran out after 2 of 3 batches") as e:
        train.evaluate(ctx, model, reader, batches=3)
    assert "passes: 0" in e.value.hint
    with pytest.raises(RunError, match="batches must be an integer >= 1"):
        train.evaluate(ctx, model, reader_op(ctx, x, y, batch_size=5), batches=0)


def test_a_full_pass_leaves_the_reader_and_n_batches_move_it_so_checkpoints_hold_it():
    body = """job: e
max_epochs: 1
init:
  - task: s
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 16, features: 2, classes: 2}
      - model.mlp: {out: model, sizes: [2, 2]}
      - reader: {in: [x, y], out: val, batch_size: 4, passes: 0}
epoch:
  - task: t
    do:
      - evaluate: {in: [model, val], out: [l, a]BATCHES}
"""
    assert checkpointed(compile_text(body.replace("BATCHES", "")))["local"] == ()
    assert checkpointed(compile_text(body.replace("BATCHES", ", batches: 4")))["local"] == ("val",)
