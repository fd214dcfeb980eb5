"""What a steady-state training step waits for with replicas, ddp and fsdp alike: no read
of a tensor's value to the host, and no blocking collective besides the gradients' own
(counted in the ranks: `Tensor.item`/`tolist`/... and torch.distributed's all_reduce,
broadcast, all_gather, barrier called without async_op). For batches a reader split,
batches cut by user code (no reader's tag: their records ride with the loss), and a model
made by user code (not wrapped by DDP or FSDP: one all-reduce of its gradients, the
gradient sync itself), BatchNorm's buffers (one broadcast) and dict batches (a reader with
`keys`, `loss: model`, a model of Hugging Face's shape with tied weights, `accumulate`
leaving a rank an empty micro-batch); and 2 replicas still train what 1 does."""

from __future__ import annotations

import pytest
from runner_util import HANG_S, ckpt_values, close, jobrun_proc, logged

HEAD = """
job: collectives
seed: 3
max_epochs: 2
parallel: PARALLEL
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:count_host_reads"}
      - call: {fn: "jobrun_test_helpers:count_collectives"}
      - data.synthetic: {out: [x, y], task: classification, n: 45, features: 6, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 8, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [6, 16, 3]}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
      - model.mlp: {out: cut, sizes: [6, 16, 3]}
      - optimizer: {in: cut, out: opt_cut, lr: 0.1, momentum: 0.9}
      - call: {fn: "jobrun_test_helpers:plain_mlp", out: plain, sizes: [6, 16, 3]}
      - optimizer: {in: plain, out: opt_plain, lr: 0.1, momentum: 0.9}
      - build:
          out: bn
          target: torch.nn.Sequential
          args: [{target: torch.nn.Linear, args: [6, 8]}, {target: torch.nn.BatchNorm1d, args: [8]},
                 {target: torch.nn.Linear, args: [8, 3]}]
      - optimizer: {in: bn, out: opt_bn, lr: 0.1, momentum: 0.9}
      - call: {fn: "jobrun_test_helpers:tokens", out: ids, n: 43}
      - reader: {in: [ids, ids], out: texts, keys: [input_ids, labels], batch_size: 8, shuffle: true, passes: 0}
      - build: {out: lm, target: "jobrun_test_helpers:TiedLM"}
      - optimizer: {in: lm, out: opt_lm, lr: 0.1, momentum: 0.9}
epoch:
  - task: train
    do:
      - call: {fn: "jobrun_test_helpers:host_reads", out: r0}  # the last epoch's log points
      - call: {fn: "jobrun_test_helpers:collectives", out: c0}
STEPS      - log: {in: [loss, loss_cut, loss_plain, loss_bn, loss_dict, reads_reader, coll_reader, reads_cut,
                   coll_cut, reads_plain, coll_plain, reads_bn, coll_bn, reads_dict, coll_dict]}
"""
# 6 steps over 45 records in batches of 8: the last batch (5) splits 3 + 2
READ = """          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
"""


def _counted(name: str, batch: str, model: str, opt: str, loss: str, step: str = "xb, yb]") -> str:
    """6 train.steps of ``model`` on batches ``batch`` makes (``step``: the rest of its
    inputs and options), then the reads and collectives counted since the previous count,
    as reads_NAME and coll_NAME."""
    return f"""      - loop: 6
        do:
{batch}          - train.step: {{in: [{model}, {opt}, {step}, out: {loss}}}
      - call: {{fn: "jobrun_test_helpers:host_reads", out: reads_{name}}}
      - call: {{fn: "jobrun_test_helpers:collectives", out: coll_{name}}}
"""


# 43 records: the last batch (3) splits 2 + 1, and accumulate leaves rank 1 an empty
# micro-batch (FSDP's collectives need its forward and backward all the same)
TEXTS = """          - read: {in: texts, out: [kb, kend]}
          - if: kend
            then: [{read: {in: texts, out: [kb, kend]}}]
"""
DICT_STEP = "kb], loss: model, accumulate: 2, clip_grad_norm: 1.0"
CUT = '          - call: {fn: "jobrun_test_helpers:rank_batch", in: [x, y], out: [xb, yb], batch: 8}\n'
PLAN = HEAD.replace("STEPS", _counted("reader", READ, "model", "opt", "loss") + _counted("cut", CUT, "cut", "opt_cut", "loss_cut")
                    + _counted("plain", READ, "plain", "opt_plain", "loss_plain")
                    + _counted("bn", READ, "bn", "opt_bn", "loss_bn")
                    + _counted("dict", TEXTS, "lm", "opt_lm", "loss_dict", DICT_STEP))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("collectives")
    for parallel in ("ddp", "fsdp"):
        (root / f"{parallel}.yaml").write_text(PLAN.replace("PARALLEL", parallel))
    for name, parallel, n in (("one", "ddp", "1"), ("ddp", "ddp", "2"), ("fsdp", "fsdp", "2")):
        r = jobrun_proc("train", root / f"{parallel}.yaml", "--run-dir", root / name, "--replicas", n,
                        timeout=HANG_S)
        assert r.code == 0, r.text
    return root


@pytest.mark.parametrize("run", ["ddp", "fsdp"])
def test_two_replicas_train_what_one_does(runs, run):
    one, two = ckpt_values(runs / "one", 2), ckpt_values(runs / run, 2)
    first = ckpt_values(runs / "one", 0)
    # (not bn: in training mode BatchNorm normalises each rank's slice, as DDP does)
    for name in ("model", "cut", "plain", "lm"):
        w1, w2 = one[name]["state"], two[name]["state"]
        assert w1.keys() == w2.keys()
        for key in w1:
            assert close(w1[key], w2[key], 1e-5), (run, name, key)
            assert w1[key] != first[name]["state"][key], (name, key)  # it trained
    got1, got2 = logged(runs / "one"), logged(runs / run)
    for key in ("loss", "loss_cut", "loss_plain", "loss_dict"):
        a, b = [r[key] for r in got1], [r[key] for r in got2]
        assert len(a) == len(b) == 2 and all(close(u, v, 1e-5) for u, v in zip(a, b)), (run, key)


@pytest.mark.parametrize("run", ["one", "ddp", "fsdp"])
def test_steps_read_nothing_to_the_host_and_wait_for_no_collective_of_their_own(runs, run):
    rows = logged(runs / run)
    assert len(rows) == 2
    for row in rows:
        # reader-split batches, user-cut batches, a user-made model: no host read at all
        assert (row["reads_reader"], row["reads_cut"], row["reads_plain"], row["reads_dict"]) == (0,) * 4, row
        assert row["coll_reader"] == row["coll_cut"] == row["coll_dict"] == 0, row
        # a model no DDP/FSDP holds: its gradients' one all-reduce a step, nothing else
        assert row["coll_plain"] == (0 if run == "one" else 6), row
        # BatchNorm's buffers follow rank 0: train.step's one broadcast a step (DDP's own
        # before each forward, torch's default, goes through its C++ reducer), no host read
        assert row["reads_bn"] == 0 and row["coll_bn"] == (0 if run == "one" else 6), row
