"""Shared helpers: timing, medians, the result rows, facts about the machine.

Every figure is a ratio against a baseline measured in the same run, with baseline and
subject alternating (the machine is shared and noisy): ``alternate`` runs them in turns
and the figures are medians over the repetitions.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mode:
    """How hard to work: ``full`` (the figures in the README), ``quick`` (CI), ``smoke``."""

    name: str

    @property
    def quick(self) -> bool:
        return self.name != "full"

    @property
    def smoke(self) -> bool:
        return self.name == "smoke"

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        return {"full": full, "quick": quick, "smoke": smoke}[self.name]


@dataclass
class Row:
    """One figure: ``value`` (in ``unit``) is the subject, ``ratio`` = subject / baseline."""

    section: str
    name: str
    value: float
    unit: str
    baseline: float | None
    baseline_name: str
    ratio: float
    goal: str
    ok: bool | None  # None: no goal, information only
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(reps: int, *fns: Callable[[], float]) -> list[list[float]]:
    """Run ``fns`` in turns ``reps`` times (the order flips every repetition, so neither
    always goes first); each returns its own measurement. One list per fn."""
    out: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        order = list(range(len(fns)))
        if r % 2:
            order.reverse()
        for i in order:
            gc.collect()
            out[i].append(fns[i]())
    return out


def paired_ratio(subject: list[float], baseline: list[float]) -> float:
    """The median of per-repetition ratios (robust to drift of a shared machine)."""
    return median([s / b for s, b in zip(subject, baseline) if b])


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu": _cpu_model(),
        "mem_gib": _mem_gib(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads_default"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    try:
        info["git"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except OSError:
        info["git"] = None
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def reader_order(n: int, pass_index: int) -> Any:
    """The order in which jobrun's shuffled reader reads pass ``pass_index`` of ``n``
    records (the first reader of node ``local`` in a plan of seed 0), from the reader's
    own seed function: a hand loop that reads in it reads the very batches the job reads."""
    import torch

    from jobrun.ops.reader import _mix

    gen = torch.Generator().manual_seed(_mix(_mix(0, "local", 0), pass_index))
    return torch.randperm(n, generator=gen)


def python_env() -> dict[str, str]:
    """The environment for child processes: the checkout importable, output unbuffered."""
    env = dict(os.environ)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = env["JOBRUN_THREADS"] = "1"  # as in this process (see run.py)
    return env


def run_python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True,
        timeout=timeout, env=python_env(), cwd=ROOT,
    )
