"""A fine-tuning script ported to a plan: a pretrained backbone (a TransformerEncoder with
LayerNorm and dropout, its weights from a .safetensors file) and a new head; AdamW with
layer-wise learning rates and no weight decay for biases and norms by `groups` rules; the
backbone frozen for the first epoch by a `call` and trained from the second; warmup +
cosine by step scaling every group's own rate, clipping, label smoothing by a loss given
by path, a full-pass `evaluate` every epoch. Its logged values (==: the evaluation's float64
mean too) and weights (torch.equal) are the hand loop's, with an overridden lr, also after
`resume --epoch 1` (a checkpoint holding a frozen backbone and no AdamW state for it);
`ckpt show` gives every group's rates."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runner_util import jobrun
from safetensors.torch import load_file, save_file

import jobrun as jr

PLAN = Path(__file__).resolve().parent / "plans" / "finetune" / "plan.yaml"
LR, BATCH, N, CLASSES, WARMUP, EPOCHS = 0.003, 32, 128, 4, 4, 3


@pytest.fixture(scope="module")
def ft():
    sys.path.insert(0, str(PLAN.parent))
    try:
        import ft
        yield ft
    finally:
        sys.path.remove(str(PLAN.parent))
        sys.modules.pop("ft", None)


@pytest.fixture
def one_thread(monkeypatch):  # float sums split by threads: the hand loop's and jobrun's alike
    monkeypatch.setenv("JOBRUN_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pretrain(ft, path: Path) -> None:
    """A few steps of another task on the backbone: its weights are the 'pretrained' file."""
    torch.manual_seed(5)
    model = ft.Classifier(6)
    x, y, _, _ = ft.make_data(n=64, classes=6, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    save_file({f"model.{k}": v for k, v in model.state_dict().items()}, path)  # as `save` writes


def _lr_at(k: int, base: float) -> float:  # docs/plan-language.md §6.8, min_ratio 0.1
    steps = EPOCHS * N // BATCH
    if k < WARMUP:
        return base * (k + 1) / (WARMUP + 1)
    lo, r = base * 0.1, (k - WARMUP) / (steps - WARMUP)
    return lo + 0.5 * (1 + math.cos(math.pi * r)) * (base - lo)


def _hand_loop(ft, pretrained: Path):
    torch.manual_seed(0)
    x, y, vx, vy = ft.make_data(n=N, classes=CLASSES, seed=3)
    model = ft.Classifier(CLASSES, pretrained=str(pretrained))
    # the plan's rules in jobrun's order: what no rule selects (head.weight), then each rule
    def group(name: str, p: torch.nn.Parameter) -> int:
        part = 0 if name.startswith("backbone.embed.") else 2 if name.startswith("backbone.") else 4
        return part + (1 if p.ndim < 2 else 2) if part < 4 else (5 if p.ndim < 2 else 0)
    options = [(0.01, LR), (0.0, LR / 4), (0.01, LR / 4), (0.0, LR / 2), (0.01, LR / 2), (0.0, LR)]
    params: list[list[torch.nn.Parameter]] = [[] for _ in options]
    for name, p in model.named_parameters():
        params[group(name, p)].append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": wd, "lr": lr}
                             for ps, (wd, lr) in zip(params, options)], lr=LR)
    initial = [g["lr"] for g in opt.param_groups]
    logs, k = [], 0
    for epoch in range(1, EPOCHS + 1):
        ft.set_trainable(model, freeze_epochs=1, epoch=epoch)
        order = jr.reader_order(N, epoch - 1, seed=0)
        losses = []
        for i in range(0, N, BATCH):
            rows = order[i:i + BATCH]
            for g, lr in zip(opt.param_groups, initial):
                g["lr"] = _lr_at(k, lr)
            opt.zero_grad(set_to_none=True)
            loss = ft.smooth_ce(model(x[rows]), y[rows])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach())
            k += 1
        model.eval()
        with torch.no_grad():  # evaluate: float64 sum of batch mean x records, / records
            outs = [(model(vx[i:i + 64]), vy[i:i + 64]) for i in range(0, len(vx), 64)]
        model.train()
        val_loss = sum(F.cross_entropy(o, t).item() * len(t) for o, t in outs) / len(vx)
        hits = sum(int((o.argmax(1) == t).sum()) for o, t in outs)
        logs.append({"loss": torch.stack(losses).mean().item(), "val_loss": val_loss,
                     "accuracy": hits / len(vx), "lr_head": opt.param_groups[0]["lr"],
                     "lr_embed": opt.param_groups[2]["lr"]})
    return model, logs


def _assert_is_the_hand_loop(run: Path, hand) -> None:
    model, logs = hand
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["values"] for r in lines if "values" in r] == logs
    saved = load_file(run / "model.safetensors")
    assert saved.keys() == {f"model.{k}" for k in model.state_dict()}
    for key, value in model.state_dict().items():
        assert torch.equal(saved[f"model.{key}"], value), key


def test_the_finetune_plan_is_its_hand_loop_to_the_last_bit_also_resumed(tmp_path, ft, one_thread):
    pretrained = tmp_path / "pretrained.safetensors"
    _pretrain(ft, pretrained)
    hand = _hand_loop(ft, pretrained)
    run = tmp_path / "run"
    r = jobrun("train", PLAN, f"vars.lr={LR}", f"vars.pretrained={pretrained}", "--run-dir", run)
    assert r.code == 0, r.text
    _assert_is_the_hand_loop(run, hand)
    shown = jobrun("ckpt", "show", run, "--epoch", "2", "--blob", "opt")
    groups = [line.strip() for line in shown.out.splitlines() if "param_groups." in line]
    assert len(groups) == 6, shown.out  # each group's options, none cut: lr and initial_lr
    for i, (line, lr) in enumerate(zip(groups, (LR, LR / 4, LR / 4, LR / 2, LR / 2, LR))):
        assert line.startswith(f"param_groups.{i} = ") and f'"initial_lr": {lr}' in line, line
        assert f'"lr": {_lr_at(7, lr)}' in line, line  # the rate of epoch 2's last step
    again = tmp_path / "again"
    shutil.copytree(run, again)
    (again / "model.safetensors").unlink()
    r = jobrun("resume", again, "--epoch", "1")
    assert r.code == 0 and "resumed from checkpoint epoch 1" in r.text, r.text
    _assert_is_the_hand_loop(again, hand)
