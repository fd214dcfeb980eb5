"""5. Memory: the resident set size of a job does not grow from epoch to epoch, and a
checkpoint save adds at most 1.1x the state size at its peak.

* A job (`jobrun train` in its own process) with an MLP and Adam, a checkpoint every
  epoch and a download group runs 8 epochs (5 in --quick); at the end of each epoch's
  task a `call` of ``benchmarks.memprobe:rss`` logs the live RSS (after a garbage
  collection and malloc_trim: memory in use, not what malloc keeps for later, which moves
  by tens of MB from one epoch to the next) and the peak RSS since the previous call (so
  the epoch's own peak, the previous epoch's save included). Figures, from epoch 2 on
  (epoch 1 creates the optimizer state): the live RSS after the last epoch over that
  after epoch 2, and the median per-epoch peak of the later half over the earlier half.
* In a fresh process: the state of the checkpoint benchmark (model + Adam), then the
  peak RSS is reset (/proc/self/clear_refs) before a synchronous ``store.save``, a
  ``prepare(copy=True)`` + ``write`` (what an async save costs in memory) and a
  ``load``: the rise of the peak over the RSS before, divided by the state's size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, Mode, Row, median, python_env
from benchmarks.inproc import metrics, write_plan

GOAL_GROWTH = 1.02
GOAL_PEAK_GROWTH = 1.05  # transient allocations move an epoch's peak by a few %
GOAL_SAVE = 1.1


def plan_for(epochs: int, hidden: int) -> dict:
    return {
        "job": "bench-memory",
        "seed": 0,
        "device": "cpu",
        "max_epochs": epochs,
        "checkpoint": {"dir": "checkpoints", "every": 1, "keep": 2},
        "init": [{"task": "setup", "do": [
            {"data.synthetic": {"out": ["x", "y"], "task": "classification", "n": 4096,
                                "features": 256, "classes": 8, "noise": 8.0}},
            {"reader": {"in": ["x", "y"], "out": "train_data", "batch_size": 256,
                        "shuffle": True, "passes": 0}},
            {"model.mlp": {"out": "model", "sizes": [256, hidden, hidden, 8]}},
            {"optimizer": {"in": "model", "out": "opt", "target": "torch.optim.Adam",
                           "lr": 0.001}},
        ]}],
        "epoch": [{"task": "train", "do": [
            {"loop": None, "do": [
                {"read": {"in": "train_data", "out": ["xb", "yb", "end"]}},
                {"stop_if": "end"},
                {"train.step": {"in": ["model", "opt", "xb", "yb"], "out": "loss"}},
            ]},
            {"call": {"fn": "benchmarks.memprobe:rss", "out": ["rss_mb", "peak_mb"]}},
            {"log": {"in": ["loss", "rss_mb", "peak_mb"], "msg": "memory"}},
        ], "outputs": ["loss"]}],
        "download": [{"task": "gather", "workspace": "global", "do": [
            {"model.gather": {"in": "model", "out": "final_state"}},
            {"call": {"fn": "benchmarks.memprobe:rss", "out": ["rss_mb", "peak_mb"]}},
            {"log": {"in": ["rss_mb", "peak_mb"], "msg": "memory"}},
        ]}],
        "exit": [{"task": "save", "do": [{"save": {"in": ["model"], "path": "model.safetensors"}}]}],
    }


def run(mode: Mode) -> list[Row]:
    epochs = mode.pick(8, 5, 3)
    hidden = mode.pick(2048, 1024, 128)
    width = mode.pick(2048, 1024, 512)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-memory-") as tmp:
        tmpd = Path(tmp)
        plan = write_plan(plan_for(epochs, hidden), tmpd)
        run_dir = tmpd / "run"
        # The save-peak probe runs meanwhile in its own process (RSS is per process).
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.memprobe", "save-peak", str(width), str(tmpd / "ck")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(), cwd=ROOT,
        )
        proc = subprocess.run(
            [sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run_dir)],
            capture_output=True, text=True, env=python_env(),
            cwd=ROOT, timeout=900,
        )
        if proc.returncode != 0:
            child.kill()
            raise RuntimeError(f"the memory job failed:\n{proc.stdout}\n{proc.stderr}")
        samples = [r for r in metrics(run_dir) if r.get("msg") == "memory"]
        per_epoch = [s["values"] for s in samples if s.get("group") == "epoch"]
        after = [s["values"] for s in samples if s.get("group") == "download"]
        rss = [v["rss_mb"] for v in per_epoch]
        peak = [v["peak_mb"] for v in per_epoch]
        # From epoch 2 on (epoch 1 creates the optimizer state and warms the allocator).
        live, peaks = rss[1:], peak[1:]
        half = len(live) // 2
        ratio = live[-1] / live[0]
        rows.append(Row(
            section="memory", name="live RSS after each epoch", value=live[-1], unit="MB",
            baseline=live[0], baseline_name="the same after epoch 2", ratio=ratio,
            goal=f"last / epoch 2 <= {GOAL_GROWTH}", ok=ratio <= GOAL_GROWTH,
            note=f"{epochs} epochs, checkpoint every epoch; per epoch: "
            + ", ".join(f"{v:.0f}" for v in rss),
            extra={"series_mb": rss, "after_download_mb": after},
        ))
        early, late = median(peaks[:half] or peaks[:1]), median(peaks[half:])
        ratio = late / early
        rows.append(Row(
            section="memory", name="peak RSS within each epoch", value=late, unit="MB",
            baseline=early, baseline_name="the same, earlier epochs", ratio=ratio,
            goal=f"later / earlier epochs (medians) <= {GOAL_PEAK_GROWTH}",
            ok=ratio <= GOAL_PEAK_GROWTH,
            note="per epoch (its save included): " + ", ".join(f"{v:.0f}" for v in peak),
            extra={"series_mb": peak},
        ))
        out, err = child.communicate(timeout=900)
        if child.returncode != 0:
            raise RuntimeError(f"the save-peak probe failed:\n{err}")
        got = json.loads(out.strip().splitlines()[-1])
    size = got["state_bytes"]
    for key, label, goal in (
        ("save", "store.save: peak added / state", GOAL_SAVE),
        ("prepare_copy_write", "prepare(copy=True) + write: peak added / state", GOAL_SAVE),
        ("load", "store.load: peak added / state", None),
    ):
        ratio = got[key] / size
        rows.append(Row(
            section="memory", name=label, value=got[key] / 1e6, unit="MB", baseline=size / 1e6,
            baseline_name="state size", ratio=ratio,
            goal=f"<= {goal}x the state" if goal else "information",
            ok=(ratio <= goal) if goal else None,
            note=f"{size / 1e6:.0f} MB state (model + Adam)",
        ))
    return rows
