"""A tiny random Hugging Face GPT-2 trained from a plan on dict batches {input_ids,
labels} (train.step's `in: [model, opt, batch]`, `loss: model`) equals the hand-written
loop of the same model and data to the last bit: every step's loss and every parameter.
The plan uses what a hand loop does: AdamW with groups, warmup + cosine by step, clipping."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from runner_util import jobrun, jobrun_proc, metrics

transformers = pytest.importorskip("transformers")

STEPS, BATCH, N, T, VOCAB = 12, 8, 48, 6, 11

PLAN = f"""\
job: hf-dicts
seed: 0
vars: {{steps: {STEPS}, dropout: 0.1}}
max_steps: ${{steps}}
init:
  - task: setup
    do:
      - call: {{fn: "hf_dict_data:tokens", out: x}}
      - reader: {{in: [x, x], out: data, keys: [input_ids, labels], batch_size: {BATCH}, passes: 0}}
      - build:
          out: model
          target: transformers:GPT2LMHeadModel
          args:
            - {{target: transformers:GPT2Config, vocab_size: {VOCAB}, n_positions: {T}, n_embd: 16,
               n_layer: 2, n_head: 2, bos_token_id: 0, eos_token_id: 0, resid_pdrop: "${{dropout}}",
               embd_pdrop: "${{dropout}}", attn_pdrop: "${{dropout}}"}}
      - optimizer: {{in: model, out: opt, class: AdamW, lr: 0.01, weight_decay: 0.1,
                    groups: [{{ndim_below: 2, weight_decay: 0.0}}]}}
      - scheduler: {{in: opt, out: sched, warmup: 2, decay: cosine, steps: "${{steps}}", min_lr: 0.001}}
epoch:
  - task: train
    do:
      - loop: 4
        do:
          - read: {{in: data, out: [batch, end]}}
          - if: end
            then: [{{read: {{in: data, out: [batch, end]}}}}]
          - train.step: {{in: [model, opt, batch], out: loss, loss: model, clip_grad_norm: 1.0}}
          - log: {{in: [loss]}}
exit:
  - task: final
    do:
      - save: {{in: [model], path: model.pt}}
"""

DATA = f"""\
import torch


def tokens():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, {VOCAB}, ({N}, {T}), generator=g)
"""


@pytest.fixture
def plan(tmp_path, monkeypatch):
    (tmp_path / "hf_dict_data.py").write_text(DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("JOBRUN_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    (tmp_path / "plan.yaml").write_text(PLAN)
    yield tmp_path / "plan.yaml"
    torch.set_num_threads(threads)


def _lr(it: int, lr: float = 0.01, warmup: int = 2, min_lr: float = 0.001) -> float:
    """The hand loop's schedule, nanoGPT's get_lr (linear warmup, then cosine)."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (STEPS - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def hand_loop() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plan, written by hand."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (N, T), generator=g)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1,
                                     attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    nodecay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0}], lr=0.01)
    losses = []
    for it in range(STEPS):
        start = it * BATCH % N
        batch = {"input_ids": x[start:start + BATCH], "labels": x[start:start + BATCH]}
        for group in opt.param_groups:
            group["lr"] = _lr(it)
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["values"]["loss"]) for r in metrics(run) if "loss" in r.get("values", {})]


def test_the_plan_on_dict_batches_equals_the_hand_loop_to_the_last_bit(plan):
    run = plan.parent / "run"
    r = jobrun("train", plan, "--run-dir", run, "--device", "cpu")
    assert r.code == 0, r.text
    losses, state = hand_loop()
    got = _losses(run)
    assert [s for s, _ in got] == list(range(STEPS))
    assert [v for _, v in got] == losses  # every step's loss, bit for bit
    assert losses[-1] < losses[0]
    saved = torch.load(run / "model.pt", weights_only=True)["model"]
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)


@pytest.mark.slow
def test_two_replicas_train_the_same_losses_as_one(plan):
    """Each rank trains on its half of every global batch (dropout off: each rank draws
    its own masks); the losses are the global batch's, equal to one process's."""
    runs = []
    for replicas in ("1", "2"):
        run = plan.parent / f"r{replicas}"
        # one replica in this process (the plan fixture's one torch thread), two in their own
        r = (jobrun if replicas == "1" else jobrun_proc)(
            "train", plan, "--run-dir", run, "--device", "cpu", "--replicas", replicas,
            "--set", "vars.dropout=0.0", "--set", "vars.steps=6")
        assert r.code == 0, r.text
        runs.append(_losses(run))
    one, two = runs
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(6))
    assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(one, two)), (one, two)
