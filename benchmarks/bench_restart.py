"""7. Restart: the time from the death of a rank to the first step of the restarted ranks.

A 2-replica job (`jobrun train --replicas 2`, `max_restarts: 1`, a small MLP, a
checkpoint every epoch) in which rank 1 SIGKILLs itself at step 5 of epoch 2. A `call`
after every `train.step` stamps the time on rank 0. The restart is the time from the
death (stamped by the dying rank just before its kill) to the first step of the
restarted ranks: the launcher noticing the death, stopping rank 0, the rendezvous,
starting two processes (Python and torch imports), init, picking and checksumming the
checkpoint, the restore and one step. The baseline is a fresh start of the same job:
from starting `jobrun train` to its first step (the same work, plus the CLI's own
start, minus the death and the restore). Both come from the same run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, Mode, Row, median, python_env

GOAL = 1.2  # a restart costs about what a start costs

PLAN = """
job: restart-bench
seed: 0
max_epochs: 3
max_restarts: 1
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 1280, features: 16, classes: 4}
      - reader: {in: [x, y], out: data, batch_size: 64, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [16, 64, 64, 4]}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
      - const: {out: epoch_no, value: 0}
epoch:
  - task: train
    do:
      - add: {in: [epoch_no, 1], out: epoch_no}
      - loop: 10
        as: i
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss}
          - call: {fn: "stamps:step", in: [epoch_no, i], path: "${plan_dir}/stamps.jsonl"}
    outputs: [loss]
"""

# The plan's own module (the plan's directory is importable by `call`).
STAMPS = '''
import json, os, signal, time

def step(epoch, i, path):
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if rank == 1 and restart == 0 and int(epoch) == 2 and int(i) == 5:
        with open(path, "a") as f:
            f.write(json.dumps({"death": time.time()}) + "\\n")
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps({"step": time.time(), "restart": restart}) + "\\n")
'''


def _one(root: Path) -> tuple[float, float]:
    """(restart seconds, fresh-start seconds) of one run."""
    root.mkdir()
    (root / "plan.yaml").write_text(PLAN)
    (root / "stamps.py").write_text(STAMPS)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "jobrun", "train", str(root / "plan.yaml"), "--run-dir",
                        str(root / "run"), "--replicas", "2"], cwd=ROOT, env=python_env(),
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0 or "restart 1:" not in p.stdout:
        raise RuntimeError(f"the restart job failed ({p.returncode}): {p.stdout[-2000:]} {p.stderr[-2000:]}")
    stamps = [json.loads(line) for line in (root / "stamps.jsonl").read_text().splitlines()]
    death = next(s["death"] for s in stamps if "death" in s)
    first = next(s["step"] for s in stamps if s.get("restart") == 0)
    again = next(s["step"] for s in stamps if s.get("restart") == 1)
    return again - death, first - t0


def run(mode: Mode) -> list[Row]:
    reps = mode.pick(3, 2, 1)
    restarts, starts = [], []
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-restart-") as tmp:
        for r in range(reps):
            restart, start = _one(Path(tmp) / str(r))
            restarts.append(restart)
            starts.append(start)
    value, base = median(restarts), median(starts)
    return [Row(
        section="restart", name="restart: death of a rank to the first new step", value=value,
        unit="s", baseline=base, baseline_name="a fresh start: `jobrun train` to the first step",
        ratio=value / base, goal=f"<= {GOAL}x a fresh start", ok=value / base <= GOAL,
        note=f"2 replicas, median of {reps}",
        extra={"restart_seconds": restarts, "start_seconds": starts},
    )]
