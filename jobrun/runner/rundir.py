"""The run directory: resolved plan, run facts, lock, metrics.

    runs/<job>/
      plan.yaml       the plan after --set (vars are substituted again on resume)
      run.json        where the plan came from, plan_dir, replicas, device, status
      metrics.jsonl   one JSON object per log line / checkpoint event
      checkpoints/    <node>.<epoch>/rank-<r>/...
      .lock           held by the running job (flock), so two runners cannot share it
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from jobrun.errors import UsageError

RUN_FILE = "run.json"
PLAN_FILE = "plan.yaml"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = ".lock"


class RunLock:
    """An exclusive flock on <run_dir>/.lock for the life of the job."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UsageError(
                f"run directory {self.path.parent} is in use by {holder}",
                hint="wait for that job to end, or choose another --run-dir",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_run_info(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RUN_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(
            f"{run_dir} is not a jobrun run directory (no {RUN_FILE})",
            hint="give the directory `jobrun train` created (runs/<job> by default)",
        ) from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None


def update_run_info(run_dir: Path, **changes: Any) -> None:
    info = read_run_info(run_dir)
    info.update(changes)
    write_json_atomic(run_dir / RUN_FILE, info)


def latest_run(root: Path = Path("runs")) -> Path:
    """The most recently started run under ./runs (by run.json's `started`)."""
    candidates = []
    if root.is_dir():
        for d in root.iterdir():
            f = d / RUN_FILE
            if f.is_file():
                try:
                    started = float(json.loads(f.read_text()).get("started", 0))
                except (OSError, ValueError):
                    continue
                candidates.append((started, d))
    if not candidates:
        raise UsageError(
            f"no runs under {root}/ to resume", hint="give --run-dir DIR, or start one with `jobrun train`"
        )
    return max(candidates)[1]


class Metrics:
    """Appends one JSON object per line to metrics.jsonl (thread-safe; rank 0 writes)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.lock = threading.Lock()
        self.file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - kept open

    def write(self, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        line = json.dumps({**record, "time": round(time.time(), 3)}, default=str)
        with self.lock:
            self.file.write(line + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def truncate_metrics(path: Path, after_epoch: int) -> None:
    """On resume from epoch E, drop what the interrupted run logged after E."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        epoch = record.get("epoch", 0)
        if record.get("group") in ("download", "exit"):
            continue  # the interrupted run's end phase runs again
        if not isinstance(epoch, int) or epoch <= after_epoch:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


class TensorBoard:
    """Also writes log values as TensorBoard scalars when `tensorboard` is installed.

    Each numeric value becomes the scalar `<task>/<name>` at step = epoch (one point per
    epoch for values logged once an epoch; later writes at the same step overwrite).
    """

    def __init__(self, run_dir: Path | None):
        self.writer = None
        if run_dir is None:
            return
        try:
            import tensorboard  # noqa: F401 - only its presence matters
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, task: str, epoch: int, values: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"{task}/{name}", value, global_step=epoch)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
