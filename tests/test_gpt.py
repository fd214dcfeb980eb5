"""plans/gpt.yaml against its hand-written loop (benchmarks/gpt_loop.py), replicas, kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runner_util import jobrun, jobrun_proc, metrics

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "gpt.yaml"
# Fewer steps than the example's 300 (this machine is small), over 3 epochs, every
# evaluation and every loss logged.
SHORT = {"steps": 40, "epoch": 15, "eval_every": 10}


def sets(**extra) -> list[str]:
    out = []
    for key, value in {**SHORT, **extra}.items():
        out += ["--set", f"vars.{key}={value}"]
    return out + ["--set", "epoch.train.log_loss.every=1"]


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("JOBRUN_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def plan_results(run: Path) -> tuple[list, list]:
    records = metrics(run)
    losses = [(r["step"], r["values"]["loss"]) for r in records if "loss" in r.get("values", {})]
    vals = [(r["step"], r["values"]["val_loss"]) for r in records if r.get("msg") == "val"]
    return losses, vals


def test_the_plan_and_the_hand_loop_agree_to_the_last_bit(tmp_path, one_thread):
    from benchmarks.gpt_loop import GPTLoop

    run = tmp_path / "run"
    r = jobrun("train", PLAN, "--run-dir", run, "--device", "cpu", *sets())
    assert r.code == 0, r.text
    loop = GPTLoop(**{k: v for k, v in SHORT.items() if k != "epoch"})
    for _ in range(SHORT["steps"]):
        loop.step()
    loop.finish()
    losses, vals = plan_results(run)
    assert len(losses) == 40 and losses == loop.losses  # every step's loss, bit for bit
    assert [s for s, _ in vals] == [0, 10, 20, 30, 40] and vals == loop.val_losses
    saved = torch.load(run / "model.pt", weights_only=True)["model"]
    hand = loop.model.state_dict()
    assert saved.keys() == hand.keys()
    assert all(torch.equal(saved[k], hand[k]) for k in hand)
    # 3 epochs of 15, 15 and 10 steps, each checkpointed; the token files are not in them
    epochs = [(r["epoch"], r["step"]) for r in metrics(run) if r.get("event") == "epoch"]
    assert epochs == [(1, 15), (2, 30), (3, 40)]
    held = jobrun("ckpt", "show", run, "--epoch", "3", "--json")
    assert held.code == 0
    blobs = set(json.loads(held.out)["nodes"]["local"])
    assert {"model", "opt", "train", "val"} <= blobs and not blobs & {"train_tokens", "val_tokens"}


def test_two_replicas_read_disjoint_windows_of_the_same_global_batches(tmp_path, one_thread):
    """With --replicas 2 each rank trains on its half of every global batch: the
    losses (global-batch means) equal one process's up to float rounding."""
    one, two = tmp_path / "one", tmp_path / "two"
    steps = ["--set", "vars.steps=6", "--set", "vars.epoch=3", "--set", "vars.eval_every=3",
             "--set", "epoch.train.log_loss.every=1"]
    for run, replicas in ((one, "1"), (two, "2")):  # one replica in this process
        r = (jobrun if replicas == "1" else jobrun_proc)(
            "train", PLAN, "--run-dir", run, "--device", "cpu", "--replicas", replicas, *steps)
        assert r.code == 0, r.text
    a, b = plan_results(one)[0], plan_results(two)[0]
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(6))
    assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(a, b))


def test_each_rank_reads_its_own_half_of_the_windows(tmp_path):
    from jobrun.ops.context import OpContext
    from jobrun.ops.data import data_load
    from jobrun.ops.reader import reader_op

    tokens = data_load(OpContext(plan_dir=PLAN.parent), path="data/gpt_train.bin", dtype="uint16")
    ranks = [reader_op(OpContext(rank=r, world_size=2), tokens, window=32, batch_size=16,
                       sample="random") for r in (0, 1)]
    whole = reader_op(OpContext(), tokens, window=32, batch_size=16, sample="random")
    for _ in range(5):
        x0, x1, x = ranks[0].read()[0], ranks[1].read()[0], whole.read()[0]
        rows0, rows1 = {tuple(r) for r in x0.tolist()}, {tuple(r) for r in x1.tolist()}
        assert len(x0) == len(x1) == 8 and not rows0 & rows1
        assert torch.equal(torch.cat([x0, x1]), x)


def test_kill_9_mid_run_then_resume_is_bit_exact(tmp_path, one_thread):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    args = ["--device", "cpu", *sets(steps=30, epoch=10)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # one torch thread, as the resume: the same sums
    r = jobrun("train", PLAN, "--run-dir", whole, *args)  # in this process (one_thread: the same sums)
    assert r.code == 0, r.text
    proc = subprocess.Popen([sys.executable, "-m", "jobrun", "train", str(PLAN), "--run-dir", str(killed),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    # kill it in epoch 2 (steps 10-19): after checkpoint 1 (saved before epoch 2 starts),
    # as early as can be, so that a loaded machine's slow poll still comes before checkpoint 2
    while not any(r.get("step", 0) >= 11 for r in metrics(killed) if "values" in r):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    r = jobrun_proc("resume", "--run-dir", killed, timeout=600)
    assert r.code == 0 and "resumed from checkpoint epoch 1" in r.text, r.text
    assert plan_results(killed) == plan_results(whole)
    a = torch.load(whole / "model.pt", weights_only=True)["model"]
    b = torch.load(killed / "model.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_example_is_a_short_clean_plan_and_its_tokens_are_reproducible(tmp_path):
    r = jobrun("analyze", PLAN, "--format", "json")
    assert r.code == 0 and json.loads(r.out)["warnings"] == 0, r.out
    lines = [line for line in PLAN.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) <= 50
    made = subprocess.run([sys.executable, str(ROOT / "plans" / "data" / "make_tokens.py"), "-o", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    for name in ("gpt_train.bin", "gpt_val.bin"):
        assert (tmp_path / name).read_bytes() == (ROOT / "plans" / "data" / name).read_bytes()
