"""A training script ported to a plan: a VAE whose step is a `call` (bf16 autocast and two
micro-batches in user code, the reparameterisation noise from the node's `generator`, the
KL weight warmed up by the `step` it is given), Adam under jobrun's schedule by step (set
before the call's own opt.step), recon and KL logged every 4 steps, the model gathered in
`download` and saved in `exit`. Its logged values (==), weights and decoded samples
(torch.equal) are the hand loop's, also after `resume --epoch 1`."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from runner_util import jobrun
from safetensors.torch import load_file

import jobrun as jr

PLAN = Path(__file__).resolve().parent / "plans" / "vae" / "plan.yaml"
LR, BATCH, STEPS, WARMUP, DECAY, MIN_LR = 0.003, 32, 8, 5, 32, 0.0003


def _vae():
    if "vae_port" not in sys.modules:
        spec = importlib.util.spec_from_file_location("vae_port", PLAN.parent / "vae_port.py")
        sys.modules["vae_port"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["vae_port"]


def _get_lr(it: int) -> float:  # nanoGPT's get_lr
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > DECAY:
        return MIN_LR
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP) / (DECAY - WARMUP))) * (LR - MIN_LR)


def _hand_loop(epochs: int):
    """The script the plan ports, in plain torch: (model, [(step, logged values)], samples)."""
    vae = _vae()
    torch.manual_seed(0)
    x, vx = vae.make_images(n=512), vae.make_images(n=128, seed=7)
    model = vae.VAE(pixels=64, hidden=32, latent=4)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(jr.node_seed(0, "local"))
    logs, it, passes, order, pos = [], 0, 0, [], 0
    for _ in range(epochs):
        for _ in range(STEPS):
            if pos >= len(order):
                order, passes, pos = jr.reader_order(len(x), passes, seed=0, node="local", reader=0), passes + 1, 0
            xb, pos = x[order[pos:pos + BATCH]], pos + BATCH
            for group in opt.param_groups:
                group["lr"] = _get_lr(it)
            loss, recon, kl = vae.step(model, opt, xb, generator=gen, step=it, kl_warmup=20)
            if it % 4 == 0:
                logs.append((it, {"recon": recon.item(), "kl": kl.item()}))
            it += 1
        logs.append((it, {"loss": loss.item(), "val_elbo": vae.elbo(model, vx).item(),
                          "lr": opt.param_groups[0]["lr"]}))
    return model, logs, vae.samples(model, n=16, generator=gen)


def _assert_is_the_hand_loop(run: Path, hand) -> None:
    model, logs, samples = hand
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["values"]) for r in lines if "values" in r] == logs
    saved = load_file(run / "model.safetensors")  # model.gather's state dict, saved in exit
    assert saved.keys() == {f"state.{k}" for k in model.state_dict()}
    for key, value in model.state_dict().items():
        assert torch.equal(saved[f"state.{key}"], value), key
    assert torch.equal(load_file(run / "samples.safetensors")["imgs"], samples)


def test_the_vae_plan_is_its_hand_loop_to_the_last_bit_also_resumed(tmp_path):
    hand = _hand_loop(3)
    run = tmp_path / "run"
    r = jobrun("train", PLAN, "max_epochs=3", "--run-dir", run)
    assert r.code == 0, r.text
    _assert_is_the_hand_loop(run, hand)
    again = tmp_path / "again"
    shutil.copytree(run, again)
    (again / "model.safetensors").unlink()
    r = jobrun("resume", again, "--epoch", "1")
    assert r.code == 0 and "resumed from checkpoint epoch 1" in r.text, r.text
    _assert_is_the_hand_loop(again, hand)
