"""The built-ins follow a hand-written loop to the bit: `build` draws from torch's global
generator as a constructor does after torch.manual_seed, and train.step's clip sums the
gradient norms in model.parameters() order (not the optimizer's groups' order)."""

from __future__ import annotations

import torch
from torch import nn

from jobrun.ops import models, train
from jobrun.ops.context import OpContext

SEQUENTIAL = "torch.nn.Sequential"


def _net() -> list[dict]:
    return [{"target": "torch.nn.Embedding", "args": [50, 32]}, {"target": "torch.nn.LayerNorm", "args": [32]},
            {"target": "torch.nn.Linear", "args": [32, 64]}, {"target": "torch.nn.GELU"},
            {"target": "torch.nn.LayerNorm", "args": [64]}, {"target": "torch.nn.Linear", "args": [64, 50]}]


def _hand_net() -> nn.Module:
    return nn.Sequential(nn.Embedding(50, 32), nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(),
                         nn.LayerNorm(64), nn.Linear(64, 50))


def test_build_draws_as_a_hand_loops_constructor_and_fork_rng_keeps_the_old_way():
    torch.manual_seed(1)
    ours = models.build(OpContext(), target=SEQUENTIAL, args=_net())
    after_ours = torch.rand(3)
    torch.manual_seed(1)
    theirs = _hand_net()
    assert torch.equal(after_ours, torch.rand(3))  # the global stream moved on alike
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    torch.manual_seed(1)
    forked = models.build(OpContext(), target=SEQUENTIAL, args=_net(), fork_rng=True)
    assert torch.equal(torch.rand(3), torch.manual_seed(1) and torch.rand(3))  # stream untouched
    assert not torch.equal(next(forked.parameters()), next(ours.parameters()))


def test_train_step_with_groups_and_clip_equals_the_hand_loop_bit_for_bit():
    seed = 1  # one where the optimizer's order gives another total norm (checked below)
    torch.manual_seed(seed)
    ours = _hand_net()
    torch.manual_seed(seed)
    theirs = _hand_net()
    rule = [{"ndim_below": 2, "weight_decay": 0.0}]
    opt = models.optimizer(OpContext(), ours, **{"class": "AdamW"}, lr=0.01, weight_decay=0.1, groups=rule)
    decay = [p for p in theirs.parameters() if p.dim() >= 2]
    nodecay = [p for p in theirs.parameters() if p.dim() < 2]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0}], lr=0.01)
    g = torch.Generator().manual_seed(5)
    ctx = OpContext()
    sensitive = False
    for _ in range(4):
        x = torch.randint(0, 50, (64,), generator=g)
        loss = train.train_step(ctx, ours, opt, x, x, clip_grad_norm=0.5)
        ref.zero_grad(set_to_none=True)
        ref_loss = nn.functional.cross_entropy(theirs(x), x)
        ref_loss.backward()
        grads = [p.grad for p in theirs.parameters()]
        by_groups = [p.grad for group in ref.param_groups for p in group["params"]]
        sensitive |= bool(torch.nn.utils.get_total_norm(grads) != torch.nn.utils.get_total_norm(by_groups))
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        ref.step()
        assert loss == ref_loss.item()
    assert sensitive, "the test's data no longer tells the two orders apart: pick another seed"
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
