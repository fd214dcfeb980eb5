"""6. Start-up: `jobrun --help` and `jobrun print plans/mlp.yaml` as new processes.

Wall time of the whole process (median of 5, alternating with the baseline), against
`python -c pass` started the same way: the ratio says how many bare interpreter
start-ups a command costs. The `jobrun` console script is used when it is on PATH (it is
what users run), else `python -m jobrun`. A separate run checks that neither command
imports torch: `python -X importtime` lists every module a process imports.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from benchmarks.common import ROOT, Mode, Row, median, python_env

GOAL_S = 0.5  # a command a person types should answer at once


def _cmd(*args: str) -> list[str]:
    exe = shutil.which("jobrun")
    return [exe, *args] if exe else [sys.executable, "-m", "jobrun", *args]


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=python_env(), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True, timeout=120)
    return time.perf_counter() - t0


def imports_torch(args: list[str]) -> bool:
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "jobrun", *args], cwd=ROOT, env=python_env(),
        capture_output=True, text=True, timeout=120,
    )
    if p.returncode != 0:
        raise RuntimeError(f"jobrun {' '.join(args)} failed: {p.stderr[-2000:]}")
    names = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if "|" in line}
    return any(n == "torch" or n.startswith("torch.") for n in names)


def run(mode: Mode) -> list[Row]:
    reps = mode.pick(5, 5, 2)
    base_cmd = [sys.executable, "-c", "pass"]
    rows: list[Row] = []
    for label, args in (("jobrun --help", ["--help"]),
                        ("jobrun print plans/mlp.yaml", ["print", "plans/mlp.yaml"])):
        cmd = _cmd(*args)
        _wall(cmd)  # warm the file cache
        base, subject = [], []
        for r in range(reps):
            pair = [(base, base_cmd), (subject, cmd)]
            for out, c in pair if r % 2 else pair[::-1]:
                out.append(_wall(c))
        torch_loaded = imports_torch(args)
        s, b = median(subject), median(base)
        rows.append(Row(
            section="startup", name=label, value=s, unit="s", baseline=b,
            baseline_name="python -c pass", ratio=s / b,
            goal=f"< {GOAL_S} s and torch not imported",
            ok=s < GOAL_S and not torch_loaded,
            note=f"median of {reps}; imports torch: {'YES' if torch_loaded else 'no'}",
            extra={"seconds": subject, "baseline_seconds": base, "imports_torch": torch_loaded},
        ))
    return rows
