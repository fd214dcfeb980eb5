"""2. Op dispatch: the cost of one core op call inside a plan.

A plan whose epoch is `loop: N` (with `as: i`) over `add: {in: [total, i], out: total}`,
`total` living in the node's global workspace (made by init) and the task private, as in
plans/counter.yaml. Its epoch's CPU time over N is the cost of one op call through the
executor (loop bookkeeping included); the baseline is a plain Python loop calling the
same function, ``jobrun.ops.core.add(ctx, total, i)``, N times. Both alternate, in this
process; the figure is the median of several repetitions.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import Mode, Row, median
from benchmarks.inproc import run_plan, write_plan

GOAL_US = 3.0


def plan_for(n: int, epochs: int) -> dict:
    return {
        "job": "bench-dispatch",
        "max_epochs": epochs,
        "init": [{"task": "setup", "do": [{"const": {"out": "total", "value": 0}}]}],
        "epoch": [{"task": "count", "do": [
            {"loop": n, "as": "i", "do": [{"add": {"in": ["total", "i"], "out": "total"}}]},
        ], "outputs": ["total"]}],
    }


def python_loop(n: int) -> float:
    """CPU seconds of n calls of core.add in a plain loop."""
    from jobrun.ops.context import OpContext
    from jobrun.ops.core import add

    ctx = OpContext()
    total = 0
    c0 = time.process_time()
    for i in range(n):
        total = add(ctx, total, i)
    return time.process_time() - c0


def run(mode: Mode) -> list[Row]:
    n = mode.pick(100_000, 100_000, 20_000)
    epochs = mode.pick(4, 3, 2)
    reps = mode.pick(7, 3, 1)
    job_us: list[float] = []
    base_us: list[float] = []
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-dispatch-") as tmp:
        plan_path = write_plan(plan_for(n, epochs), Path(tmp))
        for _ in range(reps):
            base: list[float] = []
            epochs_run = run_plan(
                plan_path, between=lambda _e, base=base: base.append(python_loop(n))
            )
            j = median([e.cpu for e in epochs_run[1:]]) / n * 1e6
            b = median(base[1:]) / n * 1e6
            job_us.append(j)
            base_us.append(b)
            ratios.append(j / b)
    us = median(job_us)
    return [Row(
        section="dispatch", name="add in a plan loop", value=us, unit="us/op",
        baseline=median(base_us), baseline_name="Python loop calling core.add", ratio=median(ratios),
        goal=f"<= {GOAL_US} us/op", ok=us <= GOAL_US,
        note=f"loop: {n}, CPU time, {epochs - 1} epochs x {reps} reps, interleaved",
        extra={"jobrun_us_per_rep": job_us, "python_us_per_rep": base_us},
    )]
