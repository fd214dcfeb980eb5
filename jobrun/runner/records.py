"""The run's records as it trains: metrics.jsonl (rank 0's) and TensorBoard scalars."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobrun import safefs
from jobrun.runner.trackers import FLUSH_S

if TYPE_CHECKING:
    from jobrun.records_schema import MetricsRecord


class Metrics:
    """Appends one JSON object per line to metrics.jsonl (thread-safe; rank 0 writes).

    Metrics never stop a job: a line that cannot be written (a full disk) is dropped,
    with one warning on stderr for the whole run.
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.warned = False
        self._open()

    def _open(self) -> None:
        if self.path is not None:
            try:
                self.fd = safefs.open_write(self.path, append=True)
            except OSError as e:
                self._drop(e)

    def reopen(self) -> None:
        """Append to the file now at the path (a resume replaced it with one that ends at
        its checkpoint)."""
        with self.lock:
            self.close()
            self._open()

    def write(self, record: dict[str, Any]) -> None:
        if self.fd is None:
            return
        line = json.dumps({**record, "time": round(time.time(), 3)}, default=str) + "\n"
        with self.lock:
            try:
                safefs.write_all(self.fd, line.encode())
            except OSError as e:
                self._drop(e)

    def _drop(self, e: OSError) -> None:
        if not self.warned:
            self.warned = True
            print(f"warning: cannot write {self.path} ({e.strerror or e}); metrics lines are "
                  "dropped from now on, training goes on", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class TensorBoard:
    """Also writes log values as TensorBoard scalars when `tensorboard` is installed.

    Each numeric value becomes the scalar `<task>/<name>` at the global step its `log`
    call sees (optimizer steps taken; see runner/clock.py), the same points
    `metrics.jsonl` holds, with the time of the call.

    A thread of its own writes them, at most every FLUSH_S seconds in one batch (and when
    the run ends), as the trackers send theirs: a scalar costs about 40 us of CPU
    (add_scalar's protobuf, then the CRC of its record in tensorboard's pure Python),
    three an epoch 0.9 % of the MLP example's epoch when written as each `log` ran.
    TensorBoard's own writer flushes its file every 120 s: a killed run loses no more.

    A run that goes on from a checkpoint (a resume, a restart) calls `restart`: the points
    the earlier run logged past it are hidden, and the resume's own take their place.

    Scalars never stop a job, as metrics lines do not: when the event file cannot be
    written (a full disk, a directory not writable) they stop, with one warning.
    """

    def __init__(self, run_dir: Path | None):
        self.writer: Any = None
        self.log_dir: Path | None = None
        self.pending: list[tuple[str, Any, int, float]] = []  # (tag, value, step, wall time)
        self.lock = threading.Lock()  # the pending list
        self.writing = threading.Lock()  # the writer (`restart` replaces it)
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None
        if run_dir is None:
            return
        try:
            import tensorboard  # noqa: F401 - only its presence matters
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        log_dir = run_dir / "tensorboard"
        # The library writes its event files by path: a link planted as the directory
        # would take them elsewhere, so only a directory of its own is written into.
        if log_dir.is_symlink() or (log_dir.exists() and not log_dir.is_dir()):
            print(f"warning: no TensorBoard scalars: {log_dir} is a link or a file, not a directory "
                  "jobrun made", file=sys.stderr, flush=True)
            return
        self.log_dir = log_dir
        _quiet_writer_threads()
        self._writer(SummaryWriter, log_dir=str(log_dir))

    def write(self, task: str, step: int, values: dict[str, Any]) -> None:
        if self.writer is not None:
            self._add(_scalars(task, step, values, time.time()))

    def restart(self, step: int, logged: Callable[[], Iterable[MetricsRecord]]) -> None:
        """Go on from a checkpoint at global step `step` (the least any node had taken):
        from here on TensorBoard shows none of the points at `step` or later that the
        event files hold (torch's `purge_step`: a new event file starts with a
        SessionLog.START at `step`, and TensorBoard drops what it read before at that step
        or later), and the run's records at those steps are written again after it:
        `logged()` gives metrics.jsonl's, which the resume cut at its checkpoint (an epoch
        saved at step S logged its last values at S too; a value of a step before `step`
        stays as it was)."""
        if self.writer is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        kept = [s for r in logged() if r.event is None and r.task is not None and r.step is not None
                and r.step >= step for s in _scalars(r.task, r.step, r.values, r.time or time.time())]
        with self.writing:
            self._flush_now()  # before the purge: the run's own values at later steps are in `kept`
            if self.writer is not None and self._writer(self.writer.close):
                self._writer(SummaryWriter, log_dir=str(self.log_dir), purge_step=step)
        with self.lock:
            self.pending[:0] = kept
        self._add([])

    def _add(self, scalars: list[tuple[str, Any, int, float]]) -> None:
        with self.lock:
            self.pending += scalars
            if self.thread is None and self.pending:
                self.thread = threading.Thread(target=self._work, name="tensorboard", daemon=True)
                self.thread.start()

    def _work(self) -> None:
        while not self.closing.wait(FLUSH_S):
            self._flush()

    def _flush(self) -> None:
        with self.writing:
            self._flush_now()

    def _flush_now(self) -> None:
        with self.lock:
            scalars, self.pending = self.pending, []
        for tag, value, step, wall in scalars:
            if self.writer is None or not self._writer(self.writer.add_scalar, tag, value,
                                                       global_step=step, walltime=wall):
                return

    def _writer(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """``call(*args, **kwargs)``, a method of the writer or SummaryWriter (what it
        returns is the writer from now on); when it cannot write, warn and write no more.
        False: it could not."""
        try:
            made = call(*args, **kwargs)
            if _thread_failed:  # a write it queued, which its thread failed to make
                raise _thread_failed.pop()
        except OSError as e:
            _thread_failed.clear()
            print(f"warning: cannot write TensorBoard scalars in {self.log_dir} ({e.strerror or e}); "
                  "no more are written, training goes on", file=sys.stderr, flush=True)
            self.writer = None
            return False
        if made is not None:
            self.writer = made
        return True

    def close(self) -> None:
        if self.writer is None:
            return
        self.closing.set()
        if self.thread is not None:
            self.thread.join()
        self._flush()
        if self.writer is not None:
            self._writer(self.writer.close)


_thread_failed: list[OSError] = []  # what tensorboard's writer thread ended on, for TensorBoard._writer


def _quiet_writer_threads() -> None:
    """tensorboard's writer thread ends on an OSError (a full disk) by raising it, which
    threading.excepthook would print as a traceback: TensorBoard._writer warns instead,
    in the thread that writes next (its writer raises it again), or at close."""
    default = threading.excepthook
    if getattr(default, "jobrun_quiet", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            _thread_failed.append(args.exc_value)
        else:
            default(args)

    hook.jobrun_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _scalars(task: str, step: int, values: dict[str, Any], wall: float) -> list[tuple[str, Any, int, float]]:
    """The TensorBoard scalars of one `log` call: its numbers, tagged `<task>/<name>`."""
    return [(f"{task}/{name}", value, step, wall) for name, value in values.items()
            if isinstance(value, int | float) and not isinstance(value, bool)]
