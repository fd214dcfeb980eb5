"""Asynchronous saves: host memory for an optimizer's new state is made ahead of the save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_util import ckpt_values, jobrun

from jobrun.runner import checkpoint as ck

PLAN = """
job: adam
seed: 1
max_epochs: 3
checkpoint: {dir: ckpt, async: ASYNC}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 6, classes: 3, seed: 0}
      - reader: {in: [x, y], out: data, batch_size: 16, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [6, 10, 3]}
      - optimizer: {in: model, out: opt, target: torch.optim.Adam, lr: 0.01}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: data, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss}
    outputs: [loss]
"""


def test_spares_are_made_in_the_background_and_taken_by_copies() -> None:
    spares = ck.Spares()
    spares.add([(torch.float32, (3, 4)), (torch.float32, (3, 4)), (torch.int64, ())])
    assert len(spares) == 3
    live = {"a": torch.randn(3, 4), "b": torch.randn(3, 4), "c": torch.randn(5)}
    want = {k: v.clone() for k, v in live.items()}
    ptrs = set()
    for dtype, shape in [(torch.float32, (3, 4))] * 2:
        t = spares.take(dtype, shape)
        ptrs.add(t.data_ptr())
        spares._free.setdefault((dtype, shape), []).insert(0, t)  # put it back
    p = ck.prepare(live, {}, copy=True, spares=spares)
    assert {p.tensors["a"].data_ptr(), p.tensors["b"].data_ptr()} == ptrs  # copied into them
    assert len(spares) == 1 and spares.take(torch.float32, (5,)) is None
    live["a"].add_(1)  # the copies are private
    assert all(torch.equal(p.tensors[k], want[k]) for k in want)
    spares.clear()
    assert len(spares) == 0


def test_an_optimizers_first_step_makes_spares_for_its_state(tmp_path: Path, monkeypatch) -> None:
    made: list[list] = []
    taken: list[bool] = []
    add, take = ck.Spares.add, ck.Spares.take
    monkeypatch.setattr(ck.Spares, "add", lambda self, like: (made.append(like), add(self, like))[1])
    monkeypatch.setattr(ck.Spares, "take", lambda self, d, s: taken.append(
        (got := take(self, d, s)) is not None) or got)
    runs = {}
    for mode in ("true", "false"):
        plan = tmp_path / f"plan-{mode}.yaml"
        plan.write_text(PLAN.replace("ASYNC", mode))
        r = jobrun("train", plan, "--run-dir", tmp_path / mode)
        assert r.code == 0, r.text
        runs[mode] = tmp_path / mode
    # Adam has no state at checkpoint 0; its first step makes 3 tensors per parameter
    # (step, exp_avg, exp_avg_sq) of 4 parameters: spares made once, all taken at epoch 1.
    assert len(made) == 1 and len(made[0]) == 12
    assert sorted(s for _, s in made[0] if s) == sorted(
        [(10, 6), (10, 6), (10,), (10,), (3, 10), (3, 10), (3,), (3,)])
    assert taken.count(True) == 12
    for epoch in (1, 2, 3):  # the same bytes as synchronous saves
        a = (runs["true"] / "ckpt" / f"local.{epoch}" / "rank-0" / "tensors.safetensors").read_bytes()
        b = (runs["false"] / "ckpt" / f"local.{epoch}" / "rank-0" / "tensors.safetensors").read_bytes()
        assert a == b and len(a) > 1000
        assert ckpt_values(runs["true"], epoch) == ckpt_values(runs["false"], epoch)


@pytest.mark.parametrize("state", ["none", "some"])
def test_no_hook_is_left_on_an_optimizer(state: str) -> None:
    from jobrun.runner.job import _spares_after_first_step

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if state == "some" else 0)
    spares = ck.Spares()
    _spares_after_first_step(opt, spares)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert not opt._optimizer_step_post_hooks  # one-shot
    assert len(spares) == (2 if state == "some" else 0)  # momentum buffers; plain SGD has none
