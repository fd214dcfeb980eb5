"""A plan with dropout on 2 replicas against a hand-written torch DDP loop (2 processes,
gloo) that does only what the porting checklist tells it (plan-language.md section 12:
"Each replica's streams", "How replicas split and weigh a batch"): the same losses at
every step and the same weights on every rank, to the last bit, also through a pass's
last batch that the replicas split 3 + 2."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from runner_util import jobrun_proc

import jobrun as jobrun_pkg

SEED, N, B, EPOCHS = 3, 21, 8, 2  # batches of 8, 8 and 5 (3 + 2 on 2 replicas) a pass

PLAN = """
job: hand-ddp
seed: {seed}
max_epochs: {epochs}
init:
  - task: setup
    do:
      - call: {{fn: "jobrun_test_helpers:dropout_data", out: [x, y], n: {n}, pure: true}}
      - reader: {{in: [x, y], out: data, batch_size: {batch}, shuffle: true, passes: 0}}
      - build: {{out: model, target: "jobrun_test_helpers:dropout_mlp"}}
      - optimizer: {{in: model, out: opt, class: AdamW, lr: 0.01}}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {{in: data, out: [xb, yb, end]}}
          - stop_if: end
          - train.step: {{in: [model, opt, xb, yb], out: loss}}
          - call: {{fn: "jobrun_test_helpers:record_loss", in: [loss], path: "{losses}"}}
exit:
  - task: final
    do:
      - call: {{fn: "jobrun_test_helpers:save_rank", in: [model], path: "{weights}"}}
"""


def _hand(rank: int, world: int, store: str, out: str, weigh: bool) -> None:
    """The hand loop of one rank, as the checklist writes it (`weigh`: its last item)."""
    import torch.distributed as dist
    from jobrun_test_helpers import dropout_data, dropout_mlp
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    random.seed(SEED)
    np.random.seed(SEED % 2**32)
    torch.manual_seed(SEED)
    x, y = dropout_data(n=N)
    model = dropout_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if rank > 0:
        s = jobrun_pkg.replica_seed(SEED, rank)
        torch.manual_seed(s)
        np.random.seed(s % 2**32)
        random.seed(s)
    ddp = DistributedDataParallel(model)
    if weigh:
        ddp.register_comm_hook(None, lambda _, bucket: dist.all_reduce(
            bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0]))
    losses = []
    for epoch in range(1, EPOCHS + 1):
        order = jobrun_pkg.reader_order(N, epoch - 1, seed=SEED)
        for i in range(0, N, B):
            batch = order[i:i + B]
            rows = torch.tensor_split(batch, world)[rank]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(ddp(x[rows]), y[rows])
            if weigh and len(rows) != len(batch):
                loss = loss * (len(rows) / len(batch))
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append((total if weigh else total / world).item())
    torch.save({"losses": losses, "model": model.state_dict()}, f"{out}.{rank}")
    dist.destroy_process_group()


def _hand_run(tmp_path, name: str, weigh: bool) -> list[dict]:
    torch.multiprocessing.spawn(_hand, args=(2, str(tmp_path / f"{name}.store"), str(tmp_path / name), weigh),
                                nprocs=2)
    return [torch.load(tmp_path / f"{name}.{rank}", weights_only=True) for rank in (0, 1)]


@pytest.mark.slow
def test_a_hand_ddp_loop_that_follows_the_checklist_gives_the_plans_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBRUN_THREADS", "1")
    losses, weights = tmp_path / "losses.jsonl", tmp_path / "weights.pt"
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(seed=SEED, epochs=EPOCHS, n=N, batch=B, losses=losses, weights=weights))
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / "run", "--replicas", "2", "--device", "cpu")
    assert r.code == 0, r.text
    lines = [json.loads(line) for line in losses.read_text().splitlines()]
    hand = _hand_run(tmp_path, "hand", weigh=True)
    for rank in (0, 1):
        assert [d["loss"] for d in lines if d["rank"] == rank] == hand[rank]["losses"]  # 6 steps
        saved = torch.load(f"{weights}.{rank}", weights_only=True)
        assert all(torch.equal(saved[k], hand[rank]["model"][k]) for k in saved)
    # DDP's own average is the plan's step while the replicas split a batch evenly, and no
    # longer from the first batch split 3 + 2 (the pass's third)
    plain = _hand_run(tmp_path, "plain", weigh=False)
    plan_losses = [d["loss"] for d in lines if d["rank"] == 0]
    assert plain[0]["losses"][:2] == plan_losses[:2] and plain[0]["losses"][2] != plan_losses[2]
