"""The runner row's epoch counted, not timed: jobrun, the loop of jobrun's ops and the hand
loop, one epoch each, in Python bytecodes or in machine instructions, so a change to the
executor or an op can be weighed without the noise of a shared machine (the row's times
move by about 1% from run to run). The bytecodes are the same in every run; the machine
instructions move by up to 2% between runs (memory layout), less between the three loops
of one run.

    python benchmarks/instructions.py --bytecodes [--tiny]   # seconds; by function
    python benchmarks/instructions.py [--tiny]      # needs valgrind and a C compiler

--bytecodes counts the bytecodes the interpreter runs (sys.settrace's opcode events), per
epoch and per function. What it showed in session 2026-11-28 (9): per step of the MLP
example jobrun runs about 490 bytecodes more than the hand loop (train.step 142, `read`'s
op and reader 226, the generated loop 98, against the hand loop's few lines), and a
bytecode costs about 20 ns there (cold caches, mispredicted dispatch): most of the row's
gap. Machine instructions barely differ (jobrun runs about as many as the hand loop, whose
`x[idx]` indexing is dearer than the reader's index_select).

One process runs bench_runner's plan (3 epochs) through the runner, and after each jobrun
epoch one epoch of each loop; callgrind counts only epoch 3 of each (jobrun's epoch group,
the loops' `run_epoch`), switched on and off by its client requests from a small C helper
(compiled here). Printed: instructions (Ir), first-level cache misses (I1/D1) and
last-level misses (LL) per epoch, and the loops' instructions over jobrun's. Instructions
are not time: between torch's kernels Python runs from cold caches, so the row's gap in
time is about twice its gap in instructions (benchmarks/cold_calls.py). PYTHONHASHSEED is
fixed so that dict layouts repeat. Takes about 2 minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HELPER = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void cg_stop(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


def count_epoch(sizes: list[int], batch: int, around: Any) -> None:
    """Run bench_runner's plan (3 epochs) and, after each jobrun epoch, one epoch of the
    hand loop and of the ops loop; epoch 3 of each runs as ``around(name, run)`` (jobrun's:
    its epoch group, as EpochResult.seconds)."""
    import torch

    import jobrun.runner.job as job
    from benchmarks.bench_runner import HandLoop, plan_for
    from benchmarks.inproc import run_plan, write_plan

    torch.set_num_threads(1)
    counted = 3
    tmp = Path(tempfile.mkdtemp(prefix="jobrun-bench-counted-"))
    loops = {"hand": HandLoop(sizes, batch, tmp / "hand.jsonl"),
             "ops": HandLoop(sizes, batch, tmp / "ops.jsonl", ops=True)}
    run_group = job.JobRunner._run_group

    def counted_group(self: Any, name: str) -> Any:
        if name != "epoch" or self.epoch != counted:
            return run_group(self, name)
        return around("jobrun", lambda: run_group(self, name))

    def between(epoch: int) -> None:
        for name, loop in loops.items():
            around(name, loop.run_epoch) if epoch == counted else loop.run_epoch()

    job.JobRunner._run_group = counted_group  # type: ignore[method-assign]
    try:
        run_plan(write_plan(plan_for(sizes, batch, counted), tmp), run_dir=tmp / "run", between=between)
    finally:
        job.JobRunner._run_group = run_group  # type: ignore[method-assign]
        shutil.rmtree(tmp, ignore_errors=True)


def child(helper: str, sizes: list[int], batch: int) -> None:
    """Inside valgrind: callgrind's client requests around epoch 3 of each."""
    import ctypes

    cg = ctypes.CDLL(helper)

    def instrumented(name: str, run: Any) -> Any:
        cg.cg_start()
        try:
            return run()
        finally:
            cg.cg_stop(name.encode())

    count_epoch(sizes, batch, instrumented)


def bytecodes(sizes: list[int], batch: int, top: int) -> None:
    """Bytecodes of epoch 3 of each (sys.settrace with opcode events), by function."""
    import collections

    from benchmarks.bench_runner import _steps_per_epoch

    counts: dict[str, collections.Counter] = {}

    def traced(name: str, run: Any) -> Any:
        seen: collections.Counter = collections.Counter()

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                seen[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
            return local

        def call(frame: Any, event: str, arg: Any) -> Any:
            frame.f_trace_opcodes = True
            return local

        sys.settrace(call)
        try:
            return run()
        finally:
            sys.settrace(None)
            counts[name] = seen

    count_epoch(sizes, batch, traced)
    steps = _steps_per_epoch(batch)
    print(f"sizes {sizes}, batch {batch} ({steps} steps): Python bytecodes in one epoch")
    for name in ("jobrun", "ops", "hand"):
        total = sum(counts[name].values())
        print(f"  {name:7} {total:>9,}  {total / steps:8.1f} a step")
    more = collections.Counter(counts["jobrun"])
    more.subtract(counts["hand"])
    print("jobrun's bytecodes a step beyond the hand loop's, by function:")
    for fn, n in more.most_common(top):
        print(f"  {n / steps:8.1f}  {fn}")


def summary(path: Path) -> tuple[str, dict[str, int]]:
    name, events, totals = "", [], []
    for line in path.read_text().splitlines():
        if line.startswith("desc: Trigger: Client Request: "):
            name = line.rsplit(" ", 1)[-1]
        elif line.startswith("events: "):
            events = line.split()[1:]
        elif line.startswith("summary: "):
            totals = [int(v) for v in line.split()[1:]]
    return name, dict(zip(events, totals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny MLP row (256 steps an epoch)")
    ap.add_argument("--bytecodes", action="store_true", help="count Python bytecodes (no valgrind)")
    ap.add_argument("--top", type=int, default=15, help="functions shown with --bytecodes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes, batch = ([4, 8, 2], 8) if args.tiny else ([16, 64, 64, 4], 64)
    if args.bytecodes:
        bytecodes(sizes, batch, args.top)
        return
    if args.child:
        child(args.child, sizes, batch)
        return
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"benchmarks/instructions.py needs {' and '.join(missing)} (apt install valgrind gcc)")
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-cg-") as tmp:
        t = Path(tmp)
        (t / "cg.c").write_text(HELPER)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(t / "cg.so"), str(t / "cg.c")], check=True)
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--cache-sim=yes",
               f"--callgrind-out-file={t}/out.%p", sys.executable, "-m", "benchmarks.instructions",
               "--child", str(t / "cg.so")] + (["--tiny"] if args.tiny else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            sys.exit(f"valgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
        got = dict(summary(p) for p in sorted(t.glob("out.*.*")))
    print(f"{'sizes ' + str(sizes) + ', batch ' + str(batch)}: one epoch, counted by callgrind")
    print(f"{'':8}" + "".join(f"{e:>14}" for e in EVENTS))
    for name in ("jobrun", "ops", "hand"):
        print(f"{name:8}" + "".join(f"{got[name].get(e, 0):>14,}" for e in EVENTS))
    ir = {name: got[name]["Ir"] for name in got}
    print(f"instructions: hand/jobrun {ir['hand'] / ir['jobrun']:.4f}, ops/jobrun {ir['ops'] / ir['jobrun']:.4f}")


if __name__ == "__main__":
    main()
