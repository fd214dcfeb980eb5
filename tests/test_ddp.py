"""Data parallel through torch's DDP: any backward through a model is synchronised (a
GAN's `call` step too), and a steady-state epoch reads no tensor value to the host."""

from __future__ import annotations

import pytest
from runner_util import ckpt_values, close, jobrun_proc, logged

PLAN = """
job: ddp
seed: 3
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:count_host_reads"}
      - data.synthetic: {out: [x, y], task: classification, n: 45, features: 6, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 8, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [6, 16, 3]}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
      - call: {fn: "jobrun_test_helpers:gan_data", out: [z, real], n: 32}
      - reader: {in: [z, real], out: pairs, batch_size: 8, shuffle: true, passes: 0}
      - model.mlp: {out: G, sizes: [2, 8, 4]}
      - model.mlp: {out: D, sizes: [4, 8, 1]}
      - optimizer: {in: G, out: opt_g, target: torch.optim.Adam, lr: 0.01}
      - optimizer: {in: D, out: opt_d, target: torch.optim.Adam, lr: 0.01}
epoch:
  - task: train
    do:
      - call: {fn: "jobrun_test_helpers:host_reads", out: between}  # the last epoch's log points
      # 6 steps over 45 records in batches of 8: the last batch (5) splits 3 + 2
      - loop: 6
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - call: {fn: "jobrun_test_helpers:host_reads", out: reads}
      - log: {in: [loss, reads, between]}
      # one task: tasks of a group run at the same time, and ranks must issue DDP's
      # collectives in one order
      - loop: 4
        do:
          - read: {in: pairs, out: [zb, rb, done]}
          - if: done
            then: [{read: {in: pairs, out: [zb, rb, done]}}]
          - call: {fn: "jobrun_test_helpers:gan_step", in: [G, D, opt_g, opt_d, zb, rb], out: [loss_d, loss_g]}
      - log: {in: [loss_d, loss_g]}
"""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    (root / "plan.yaml").write_text(PLAN)
    for n in ("1", "2"):
        r = jobrun_proc("train", root / "plan.yaml", "--run-dir", root / f"r{n}", "--replicas", n)
        assert r.code == 0, r.text
    return root


def test_a_gan_step_written_as_a_call_trains_the_same_models_on_two_replicas(runs):
    """Its backwards go through DDP's hooks: without them the replicas drift apart."""
    one, two = ckpt_values(runs / "r1", 2), ckpt_values(runs / "r2", 2)
    first = ckpt_values(runs / "r1", 0)
    for name in ("G", "D", "model"):
        w1, w2 = one[name]["state"], two[name]["state"]
        assert w1.keys() == w2.keys() == first[name]["state"].keys()  # the module's own keys
        for key in w1:
            assert close(w1[key], w2[key], 1e-5), (name, key)
            assert w1[key] != first[name]["state"][key], (name, key)  # it trained
    # train.step's loss is the global batch's on every rank (a `call`'s losses are the
    # user's, each rank's own)
    got1 = [r["loss"] for r in logged(runs / "r1") if "loss" in r]
    got2 = [r["loss"] for r in logged(runs / "r2") if "loss" in r]
    assert len(got1) == len(got2) == 2 and all(close(a, b, 1e-5) for a, b in zip(got1, got2))


def test_training_steps_read_no_tensor_value_to_the_host(runs):
    """train.step leaves its loss on the device; the loop reads nothing (the uneven last
    batch's weights come from the reader's split, the stop flags through CPU memory)."""
    for run in ("r1", "r2"):
        rows = [r for r in logged(runs / run) if "reads" in r]
        assert [r["reads"] for r in rows] == [0, 0], run
        assert rows[1]["between"] > 0  # the counter counts: epoch 1's log and epoch line read

