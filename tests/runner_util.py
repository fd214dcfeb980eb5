"""Helpers for runner tests: run the CLI in-process or as a subprocess, read results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from jobrun.cli import main


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def jobrun(*args: str) -> Result:
    """Run `jobrun ARGS` in this process (fast: torch is imported once per session)."""
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


# A guard against a hung test, never a verdict: on a loaded machine anything may take
# minutes (JOBRUN_TEST_HANG_S changes it).
HANG_S = float(os.environ.get("JOBRUN_TEST_HANG_S", 3600))


def jobrun_proc(*args: str, cwd: Path | None = None, timeout: float = HANG_S) -> Result:
    p = subprocess.run(
        [sys.executable, "-m", "jobrun", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return Result(p.returncode, p.stdout, p.stderr)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged(run_dir: Path, msg: str | None = None) -> list[dict]:
    """The `values` of every log record (optionally only those with this msg)."""
    return [
        {**r["values"], "_epoch": r["epoch"], "_task": r["task"]}
        for r in metrics(run_dir)
        if "values" in r and (msg is None or r.get("msg") == msg)
    ]


def close(a, b, tol: float) -> bool:
    """Numbers (or nested lists of them) equal to a relative tolerance (absolute below 1)."""
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol * max(1.0, abs(a))


def ckpt_values(run_dir: Path, epoch: int, node: str = "local") -> dict:
    r = jobrun("ckpt", "show", run_dir, "--epoch", str(epoch), "--node", node, "--json")
    assert r.code == 0, r.text
    return json.loads(r.out)["nodes"][node]


# An MLP trained on data.npz (write_data): each epoch a pass of a reader made in init.
_DATA_PLAN = """
job: data
max_epochs: 3
checkpoint: CHECKPOINT
init:
  - task: setup
    do:
      - data.load: {out: [x, y], path: data.npz, keys: [x, y]}
      - reader: {in: [x, y], out: r, batch_size: 4, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [3, 2]}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: r, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - log: {in: [loss]}
"""


def data_plan(keep: int | None = None) -> str:
    """The plan of data.npz, keeping ``keep`` checkpoints (None: the default)."""
    checkpoint = "{dir: ckpt}" if keep is None else f"{{dir: ckpt, keep: {keep}}}"
    return _DATA_PLAN.replace("CHECKPOINT", checkpoint)


def write_data(path: Path, scale: float = 1.0) -> None:
    """data.npz for :func:`data_plan`: 16 records of 3 features (times ``scale``), 2 classes."""
    gen = np.random.default_rng(0)
    np.savez(path, x=(gen.normal(size=(16, 3)) * scale).astype(np.float32), y=gen.integers(0, 2, 16))
