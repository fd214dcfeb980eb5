"""5. Memory: the resident set size of a job does not grow from epoch to epoch, and a
checkpoint save adds at most 1.1x the state size at its peak.

* A job (`jobrun train` in its own process) with an MLP, a checkpoint every epoch and a
  download group runs 5 epochs (3 in --quick); at the end of each epoch's task a `call`
  of ``benchmarks.memprobe:rss`` logs the current and the peak RSS (the peak covers the
  previous epoch's checkpoint save). The figure is the RSS after the last epoch over the
  RSS after epoch 2 (epoch 1 creates the optimizer state and warms the allocator), and
  the same for the peak.
* In a fresh process: the state of the checkpoint benchmark (model + Adam), then the
  peak RSS is reset (/proc/self/clear_refs) before a synchronous ``checkpoint.save``, a
  ``prepare(copy=True)`` + ``write`` (what an async save costs in memory) and a
  ``load``: the rise of the peak over the RSS before, divided by the state's size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, Mode, Row, python_env
from benchmarks.inproc import metrics, write_plan

GOAL_GROWTH = 1.02
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
    epochs = mode.pick(5, 3, 3)
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
        ref = 1  # after epoch 2
        for name, series in (("RSS after each epoch", rss), ("peak RSS after each epoch", peak)):
            ratio = series[-1] / series[ref]
            rows.append(Row(
                section="memory", name=name, value=series[-1], unit="MB", baseline=series[ref],
                baseline_name="the same after epoch 2", ratio=ratio,
                goal=f"last / epoch 2 <= {GOAL_GROWTH}", ok=ratio <= GOAL_GROWTH,
                note=f"{epochs} epochs, checkpoint every epoch; per epoch: "
                + ", ".join(f"{v:.0f}" for v in series),
                extra={"series_mb": series, "after_download_mb": after},
            ))
        out, err = child.communicate(timeout=900)
        if child.returncode != 0:
            raise RuntimeError(f"the save-peak probe failed:\n{err}")
        got = json.loads(out.strip().splitlines()[-1])
    size = got["state_bytes"]
    for key, label, goal in (
        ("save", "checkpoint.save: peak added / state", GOAL_SAVE),
        ("prepare_copy_write", "prepare(copy=True) + write: peak added / state", GOAL_SAVE),
        ("load", "checkpoint.load: peak added / state", None),
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
