"""Sparse gradients (nn.Embedding(sparse=True)) with replicas: gathered over ranks, so that
1 and 2 replicas train the same model and the gradient stays sparse for the optimizer."""

from __future__ import annotations

import shutil

import pytest
from runner_util import ckpt_values, close, jobrun_proc, logged

MODEL = '''
import torch
from torch import nn


def tokens(n: int, vocab: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, length), generator=g)
    y = (x[:, 0] % 3).long()  # the class is in the first token
    return x, y


class Bag(nn.Module):
    def __init__(self, vocab: int, dim: int, classes: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, sparse=True)
        self.out = nn.Linear(dim, classes)

    def forward(self, x):
        return self.out(self.emb(x).mean(dim=1))
'''

PLAN = """
job: sparse
seed: 2
max_epochs: 3
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:count_host_reads"}
      - call: {fn: "jobrun_test_helpers:count_collectives"}
      - call: {fn: "bag:tokens", out: [x, y], n: 90, vocab: 200, length: 5, seed: 4}
      - reader: {in: [x, y], out: data, batch_size: 18, shuffle: true, passes: 0}
      - build: {in: [200, 16, 3], out: model, target: "bag:Bag"}
      - optimizer: {in: model, out: opt, target: torch.optim.SGD, lr: 0.5}
epoch:
  - task: train
    do:
      - call: {fn: "jobrun_test_helpers:host_reads", out: r0}  # the last epoch's log points
      - call: {fn: "jobrun_test_helpers:collectives", out: c0}
      - loop: 5
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - call: {fn: "jobrun_test_helpers:host_reads", out: reads}
      - call: {fn: "jobrun_test_helpers:collectives", out: colls}
      - log: {in: [loss, reads, colls]}
"""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    (root / "bag.py").write_text(MODEL)
    (root / "plan.yaml").write_text(PLAN)
    for n in ("1", "2"):
        r = jobrun_proc("train", root / "plan.yaml", "--run-dir", root / f"r{n}", "--replicas", n)
        assert r.code == 0, r.text
    return root


def _weights(run, epoch=3):
    return ckpt_values(run, epoch)["model"]["state"]


def test_one_and_two_replicas_train_the_same_embedding(runs):
    w1, w2 = _weights(runs / "r1"), _weights(runs / "r2")
    assert w1.keys() == w2.keys() == {"emb.weight", "out.weight", "out.bias"}
    for key in w1:
        assert close(w1[key], w2[key], 1e-5), key
    first = ckpt_values(runs / "r1", 0)["model"]["state"]["emb.weight"]
    changed = [i for i, (a, b) in enumerate(zip(first, w1["emb.weight"])) if a != b]
    assert 0 < len(changed) < 200  # rows that were read moved; the sparse update left others
    l1 = [r["loss"] for r in logged(runs / "r1")]
    l2 = [r["loss"] for r in logged(runs / "r2")]
    assert len(l1) == len(l2) == 3 and all(close(a, b, 1e-4) for a, b in zip(l1, l2))
    assert l1[-1] < l1[0]


def test_sparse_rows_take_collectives_of_their_own(runs):
    """What DDP's dense buckets cannot carry (docs/data-parallel.md): each step gathers the
    ranks' row counts (read to the host, to size the buffers), then the rows' indices and
    values; one process does neither."""
    assert [(r["reads"], r["colls"]) for r in logged(runs / "r1")] == [(0, 0)] * 3
    assert [(r["reads"], r["colls"]) for r in logged(runs / "r2")] == [(5, 15)] * 3  # 5 steps


def test_two_replicas_with_sparse_gradients_resume_exactly(runs, tmp_path):
    run = tmp_path / "r2"
    shutil.copytree(runs / "r2", run)
    r = jobrun_proc("resume", "--run-dir", run, "--epoch", "1")
    assert r.code == 0, r.text
    assert _weights(run) == _weights(runs / "r2")
