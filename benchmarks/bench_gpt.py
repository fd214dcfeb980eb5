"""gpt: plans/gpt.yaml (a tiny GPT, nanoGPT's loop as a plan) vs its hand-written loop.

Both run in this process on one torch thread, alternating epoch by epoch: after each of
the plan's epochs (`epoch` steps, its evaluations included), the hand loop of
benchmarks/gpt_loop.py takes the same steps. Both compute the same numbers (the losses
are checked equal), so the ratio is the cost of running the program as a plan: the
executor, the ops, the global step's hooks and the scheduler. The copy of the plan
writes no checkpoints (the hand loop has none); both are timed in CPU seconds (a shared
machine's wall clock waits for other processes), the first epoch is a warm-up.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT, Mode, Row, median
from benchmarks.inproc import metrics, run_plan

GOAL = 0.98
PLANS = ROOT / "plans"


def plan_copy(directory: Path, steps: int, epoch: int) -> Path:
    """plans/gpt.yaml with `steps` and `epoch` set and no checkpoints, beside copies of its
    model and data."""
    plan = yaml.safe_load((PLANS / "gpt.yaml").read_text())
    plan["vars"].update(steps=steps, epoch=epoch)
    plan.pop("checkpoint")
    for sub in ("models", "data"):
        shutil.copytree(PLANS / sub, directory / sub, ignore=shutil.ignore_patterns("*.py", "*.npz")
                        if sub == "data" else None)
    path = directory / "gpt.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def run(mode: Mode) -> list[Row]:
    import torch

    from benchmarks.gpt_loop import GPTLoop

    torch.set_num_threads(1)
    steps, epoch = mode.pick((300, 50), (300, 50), (20, 10))
    reps = mode.pick(3, 1, 1)
    plan_s: list[float] = []
    hand_s: list[float] = []
    same = True
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-gpt-") as tmp:
        path = plan_copy(Path(tmp), steps, epoch)
        for rep in range(reps):
            hand = GPTLoop(steps=steps)
            times: list[float] = []

            def between(_: int, hand=hand, times=times) -> None:
                t0 = time.process_time()
                for _ in range(min(epoch, steps - hand.iter_num)):
                    hand.step()
                times.append(time.process_time() - t0)

            run_dir = Path(tmp) / f"run{rep}"
            job = run_plan(path, run_dir=run_dir, between=between)
            logged = [(r["step"], r["values"]["loss"]) for r in metrics(run_dir)
                      if "loss" in r.get("values", {})]
            same &= bool(logged) and all(pair in hand.losses for pair in logged)
            plan_s += [e.cpu for e in job[1:]]
            hand_s += times[1:]
    sps_plan, sps_hand = epoch / median(plan_s), epoch / median(hand_s)
    ratio = sps_plan / sps_hand
    return [Row(
        section="gpt", name="plans/gpt.yaml steps/s", value=sps_plan, unit="steps/s",
        baseline=sps_hand, baseline_name="hand-written nanoGPT loop (benchmarks/gpt_loop.py)",
        ratio=ratio, goal=f"plan/hand >= {GOAL}", ok=ratio >= GOAL,
        note=f"{steps} steps in epochs of {epoch}, {reps} rep(s), first epoch a warm-up; "
        f"same losses: {same}",
        extra={"same_losses": same, "plan_epoch_seconds": plan_s, "hand_epoch_seconds": hand_s},
    )]
