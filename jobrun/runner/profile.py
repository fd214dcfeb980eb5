"""`train --profile`: the time each plan step takes, per task and group.

With the profile on, the executor generates timed code: around each op call (and each
loop) it reads ``time.perf_counter`` and adds the difference to the step's slot, a
two-item list ``[calls, seconds]`` the generated module holds as a global. With it off the
generated code is the same as without this module, so the profile costs nothing then.
On a GPU each timed op call also waits for the device (``torch.cuda.synchronize``), so
that the time of the kernels it launched is its own rather than the next sync's.

Threads (parallel branches, a task's instances, concurrent tasks) add to the same slots
without a lock: an update may rarely be lost there, which a profile can afford. The
runner times each task and group too; at the end of the run the table (slowest step
first, with its share of its group's time) is printed and written into the run directory
as ``profile.txt`` and ``profile.json``.

``--profile torch`` (or ``--profile-steps N``) also records a ``torch.profiler`` trace of
N steady-state iterations of the epoch's innermost loops (after `TORCH_WAIT` of them) into
``<run dir>/profile/``: one ``*.pt.trace.json`` file, which Chrome's ``chrome://tracing``,
Perfetto and TensorBoard's profiler plugin (``tensorboard --logdir <run dir>``: its run
``profile``, as ``torch.profiler.tensorboard_trace_handler`` lays a trace out) read.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobrun import safefs

PROFILE_TEXT = "profile.txt"
PROFILE_JSON = "profile.json"
TRACE_DIR = "profile"
TORCH_WAIT = 5  # iterations skipped before the trace (warm-up: allocator, caches, autotuning)
TORCH_STEPS = 5  # iterations traced by `--profile torch`


@dataclass
class Slot:
    """One timed plan step."""

    group: str
    task: str
    where: str  # file:line
    what: str  # the op, or `loop`
    times: list[float] = field(default_factory=lambda: [0, 0.0])  # [calls, seconds]


class Profile:
    """The run's step times; `slot` is called by the executor while it generates code."""

    def __init__(self, device: str = "cpu", torch_steps: int = 0):
        self.slots: list[Slot] = []
        self.tasks: dict[tuple[str, str], list[float]] = {}  # (group, task) -> [runs, seconds]
        self.groups: dict[str, list[float]] = {}  # group -> [runs, seconds]
        self.sync: Callable[[], None] | None = _cuda_sync(device)
        self.trace = TorchTrace(torch_steps, device) if torch_steps else None

    def slot(self, group: str, task: str, where: str, what: str) -> list[float]:
        s = Slot(group, task, where, what)
        self.slots.append(s)
        return s.times

    def timed(self, table: dict[Any, list[float]], key: Any, seconds: float) -> None:
        t = table.setdefault(key, [0, 0.0])
        t[0] += 1
        t[1] += seconds

    def run_group(self, name: str, tasks: list[Any], run_tasks: Callable[..., Any]) -> Any:
        """The runner's `run_tasks(name, tasks, run)` with each task and the group timed."""

        def run(t: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return t.run()
            finally:
                self.timed(self.tasks, (name, t.task.name), time.perf_counter() - t0)

        t0 = time.perf_counter()
        try:
            return run_tasks(name, tasks, run)
        finally:
            self.timed(self.groups, name, time.perf_counter() - t0)

    def report(self, display: Any, run_dir: Path) -> None:
        """The end of a run (rank 0): the table on the console and in the run directory,
        and where the torch trace went."""
        note = self.trace.finish() if self.trace is not None else None
        for line in self.text().splitlines():
            display.line(line)
        try:
            paths = self.write(run_dir)
            display.line(f"profile written to {paths[0]} and {paths[1].name}")
        except OSError as e:
            display.warn(f"the profile was not written to {run_dir}: {e.strerror or e}")
        if self.trace is not None and self.trace.path is not None:
            display.line(f"torch trace: {self.trace.path} (chrome://tracing, ui.perfetto.dev, or "
                         f"tensorboard --logdir {run_dir}: its run `{TRACE_DIR}`)")
        if note:
            display.warn(note)

    # -- the table ------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """Every task and step that ran, by group (in run order), the slowest first."""
        out: list[dict[str, Any]] = []
        for group, (runs, group_s) in self.groups.items():
            rows = [_row(group, task, "", "(task)", t, group_s)
                    for (g, task), t in self.tasks.items() if g == group]
            rows += [_row(group, s.task, s.where, s.what, s.times, group_s)
                     for s in self.slots if s.group == group and s.times[0]]
            rows.sort(key=lambda r: -r["total_s"])
            out.append({"group": group, "runs": int(runs), "total_s": round(group_s, 6), "rows": rows})
        return out

    def text(self) -> str:
        groups = self.rows()
        if not groups:
            return "profile: no group ran"
        head = f"{'task':<14} {'step':<34} {'calls':>8} {'total s':>9} {'mean ms':>9} {'share':>6}"
        lines = ["profile: time per plan step, the slowest first (share: of the group's time)"]
        for g in groups:
            runs = f" ({g['runs']} times)" if g["runs"] > 1 else ""
            lines += ["", f"{g['group']}{runs}: {g['total_s']:.3f} s", head]
            for r in g["rows"]:
                step = f"{r['where']} {r['step']}".strip()
                lines.append(f"{r['task'][:14]:<14} {step[-34:]:<34} {r['calls']:>8} "
                             f"{r['total_s']:>9.3f} {r['mean_ms']:>9.3f} {r['share']:>6.1%}")
        if self.sync is not None:
            lines += ["", "(on the GPU each timed step waited for its kernels: the steps ran "
                          "slower than without --profile)"]
        return "\n".join(lines)

    def write(self, run_dir: Path) -> list[Path]:
        """profile.txt and profile.json in the run directory (each replaced whole)."""
        text, data = self.text() + "\n", {"groups": self.rows(), "synchronized": self.sync is not None}
        paths = [run_dir / PROFILE_TEXT, run_dir / PROFILE_JSON]
        safefs.write_atomic(paths[0], text.encode(), durable=False)
        safefs.write_atomic(paths[1], (json.dumps(data, indent=1) + "\n").encode(), durable=False)
        return paths


def for_run(device: str, torch_steps: int, run_dir: Path, main_rank: bool) -> Profile:
    """A run's profile; rank 0 writes the torch trace into ``run_dir/profile``."""
    p = Profile(device, torch_steps)
    if p.trace is not None and main_rank:
        p.trace.out_dir = run_dir / TRACE_DIR
    return p


def _row(group: str, task: str, where: str, step: str, times: list[float], group_s: float) -> dict[str, Any]:
    calls, total = int(times[0]), times[1]
    return {"group": group, "task": task, "where": where, "step": step, "calls": calls,
            "total_s": round(total, 6), "mean_ms": round(total / calls * 1000, 6) if calls else 0.0,
            "share": round(total / group_s, 4) if group_s > 0 else 0.0}


def _cuda_sync(device: str) -> Callable[[], None] | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.synchronize


class TorchTrace:
    """A torch.profiler trace of `steps` loop iterations after `TORCH_WAIT` of them.

    The executor calls `step()` at each iteration of the epoch group's innermost loops
    (only with the trace asked for); `finish` writes the trace when it has not been yet.
    """

    def __init__(self, steps: int, device: str, wait: int = TORCH_WAIT):
        self.steps = steps
        self.wait = wait
        self.device = device
        self.count = 0
        self.prof: Any = None
        self.path: Path | None = None  # the trace written
        self.out_dir: Path | None = None  # set by the runner (rank 0's run directory)

    def step(self) -> None:
        self.count += 1
        if self.out_dir is None:
            return
        if self.count == self.wait + 1:
            self._start()
        elif self.count == self.wait + self.steps + 1 and self.prof is not None:
            self._stop()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.__enter__()

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        assert self.out_dir is not None
        # torch writes the file itself: into a private temporary directory, then copied
        # into the run directory through safefs (which refuses a planted symlink there).
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            data = raw.read_bytes()
        os.makedirs(self.out_dir, exist_ok=True)
        # The name TensorBoard's profiler plugin looks for: <worker>.<time>.pt.trace.json
        name = f"{socket.gethostname()}_{os.getpid()}.{int(time.time() * 1000)}.pt.trace.json"
        self.path = self.out_dir / name
        safefs.write_atomic(self.path, data, durable=False)

    def finish(self) -> str | None:
        """At the end of the run: a trace still recording is written with the iterations
        it has; a note when none was recorded."""
        if self.prof is not None:
            self._stop()
            return f"torch trace of {self.count - self.wait} iteration(s) only (the run ended first)"
        if self.path is None and self.out_dir is not None:
            return (f"no torch trace: the epoch loops ran {self.count} iteration(s), the trace "
                    f"starts after {self.wait}")
        return None
