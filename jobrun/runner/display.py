"""What a person sees while a job runs, and the run's console.log.

On a terminal: a rich progress bar for the running epoch (steps done / steps per epoch
when known, steps/s, elapsed, ETA, the latest logged values), with one summary line per
epoch scrolling above it. Elsewhere (logs, CI, pipes): the same summary lines as plain
text, plus a progress line every ``heartbeat`` seconds during a long epoch so that a log
shows life; never a control character. Every line shown is also appended to
``<run dir>/console.log``. Only rank 0 shows anything.

A step is an iteration of the innermost running loop. The executor writes
``progress["loop"] = (key, iterator, n, started)`` as a loop starts (also under its key in
``progress["loops"]``), and puts back the entry it replaced when the loop ends (an
enclosing loop, or a `parallel` branch's still running); a `report`'s loops write none.
The iterator is the one its `for` runs over: ``iter(range(n))``, or ``iter(FOREVER)`` for
a loop without a count (`loop: null`), whose length is not known in its first epoch; from
the second on, that loop's count in the previous epoch is the total. How far the iterator
went is the number of steps begun; steps/s are those of the loop since it started
(`time.perf_counter()`), so that an inner loop that starts again is not measured against
the whole epoch.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import threading
import time
from collections.abc import Container, Iterable
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from jobrun.errors import env_seconds

FOREVER = range(sys.maxsize)  # what a loop without a count iterates over


def begun(iterator: Any, n: int | None) -> int:
    """The iterations a loop over ``iter(range(n))`` (``iter(FOREVER)`` when n is None)
    has begun: its length less what the iterator has left."""
    return (len(FOREVER) if n is None else n) - operator.length_hint(iterator)


def _stdout_closed() -> None:
    """Stop as SIGPIPE stops a command whose output's reader left, but cleanly: the line
    comes after the epoch's checkpoint, the run is recorded interrupted and resumes. stdout
    goes to /dev/null first, so that nothing written later (Python's own flush at exit, a
    thread's progress line) fails again; only the main thread stops the job."""
    import signal

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    if threading.current_thread() is threading.main_thread():
        from jobrun.errors import Interrupted

        raise Interrupted(signal.SIGPIPE)


class Display:
    def __init__(self, enabled: bool = True, tty: bool | None = None, log: Path | None = None,
                 heartbeat: float | None = None):
        self.enabled = enabled
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.heartbeat = env_seconds("JOBRUN_PROGRESS_SECONDS") if heartbeat is None else heartbeat
        # Written by the executor's loops (task, iteration, count), read by the ticker.
        self.progress: dict[str, Any] = {}
        self.quiet: frozenset[str] = frozenset()  # outputs shown only when true (stop flags)
        self._log_path = log if enabled else None
        self._log: Any = None
        self._progress_bar: Any = None
        self._bar_task: Any = None
        self._bar_loop: Any = None  # the progress entry the bar shows (a new one resets it)
        self._job = ""
        self._what = "starting"
        self._t0 = time.monotonic()
        self._epoch_t0 = time.monotonic()
        self._values: dict[tuple[str, str], Any] = {}  # (task, name): logged in the running epoch
        self._columns: dict[str, None] = {}  # the epoch lines' names, in the order first shown
        self._shared: set[str] = set()  # names two tasks gave in one epoch: shown as task.name
        self._counts: dict[str, int] = {}  # steps of each loop (by key) in the last epoch
        self._last_beat = time.monotonic()
        self._feed_start = (0, 0)  # records and tokens read when the running group started
        self._lock = threading.Lock()

    # -- the run ------------------------------------------------------------------------
    @contextmanager
    def live(self, job: str, stop_names: frozenset[str] = frozenset()):
        self._job = job
        self.quiet = stop_names
        self._t0 = time.monotonic()
        self._open_log()
        stop = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(stop,), daemon=True)
        try:
            if self.enabled and self.tty:
                self._progress_bar = _progress_bar()
                self._bar_task = self._progress_bar.add_task(f"{job} starting", total=None, samples="", values="")
                self._progress_bar.start()
            if self.enabled:
                ticker.start()
            yield self
        finally:
            stop.set()
            if ticker.is_alive():
                ticker.join()
            if self._progress_bar is not None:
                self._progress_bar.stop()
                self._progress_bar = None
            self._close_log()

    def status(self, what: str) -> None:
        """A group starts: `init`, `epoch N`, `download`, `exit`."""
        self._remember_counts()
        self._what = what
        self.progress.pop("loop", None)
        self._values = {}
        self._feed_start = self._records()
        self._epoch_t0 = self._last_beat = time.monotonic()
        if self._progress_bar is not None:  # a new task: rich cannot set a known total back to none
            self._progress_bar.remove_task(self._bar_task)
            self._bar_task = self._progress_bar.add_task(f"{self._job} {what}", total=None, samples="",
                                                          values="")

    def logged(self, group: str, epoch: int, task: str, values: dict[str, Any], msg: str | None) -> None:
        """A `log` op's values: during an epoch they go into its summary line and the
        progress bar; in the other groups each call is a line of its own."""
        if group == "epoch":
            with self._lock:
                self._values.update({(task, k): v for k, v in values.items()})
            return
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        self.line(f"[{group} {task}] {msg + ': ' if msg else ''}{shown}")

    def epoch_line(self, result: Any, max_epochs: int | None, max_steps: int | None = None) -> None:
        """`epoch 2/8  loss=0.227 ...  0.06s  ...  ckpt ...`; with `max_steps` the global
        step follows the epoch (`epoch 2  step 200/300`): it, not the epoch, ends the job."""
        of = f"/{max_epochs}" if max_epochs else ""
        step = getattr(result, "step", None)
        steps = f"step {step}/{max_steps}" if max_steps and step is not None else ""
        values = dict(self._values)
        for task, outputs in result.outputs.items():
            values.update({(task, k): v for k, v in outputs.items()})
        order = {task: i for i, task in enumerate(result.outputs)}  # the plan's (tasks log in any order)
        values = dict(sorted(values.items(), key=lambda item: order.get(item[0][0], len(order))))
        newly = shared_names(values) - self._shared
        self._shared |= newly
        labelled = {task_label(task, k, self._shared): (k, v) for (task, k), v in values.items()}
        # A name keeps its place from one epoch line to the next (the `log` that runs first
        # may differ between epochs: `every: N`), new names after the others; a name two
        # tasks now give is shown as each task's in its place.
        self._columns = dict.fromkeys(c for column in self._columns for c in (
            [label for label, (k, _) in labelled.items() if k == column] if column in newly else [column]))
        self._columns.update(dict.fromkeys(labelled))
        outs = " ".join(f"{label}={_fmt(v)}" for label, (k, v) in
                        ((label, labelled[label]) for label in self._columns if label in labelled)
                        if not (k in self.quiet and not _true(v)))
        from jobrun.runner.throughput import epoch_text

        rates = epoch_text(getattr(result, "rates", {}), result.seconds, human_size)
        parts = [f"epoch {result.epoch}{of}", steps, outs, f"{result.seconds:.2f}s", rates, result.ckpt]
        self.line("  ".join(p for p in parts if p))

    # -- lines ----------------------------------------------------------------------------
    def line(self, text: str) -> None:
        if not self.enabled:
            return
        self.to_log(text)  # first: the line a closed output refuses stays in console.log
        if self._progress_bar is not None:
            self._progress_bar.console.print(text, markup=False, highlight=False)
        else:
            try:
                print(text, flush=True)
            except BrokenPipeError:  # `jobrun train ... | head`: the reader went away
                _stdout_closed()

    def warn(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress_bar is not None:
            self._progress_bar.console.print(f"[bold yellow]warning:[/] {text}", highlight=False)
        else:
            print(f"warning: {text}", file=sys.stderr, flush=True)
        self.to_log(f"warning: {text}")

    def to_log(self, text: str) -> None:
        """Append a line to console.log only (e.g. the error the CLI prints)."""
        if self._log is None:
            return
        try:
            self._log.write(text + "\n")
        except OSError:
            self._close_log()  # a full disk: the console goes on without its copy

    # -- progress ---------------------------------------------------------------------------
    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(0.2):
            self._refresh()

    def _step(self, loop: Any = None) -> tuple[int, int | None] | None:
        """Steps done in the running loop (`loop`: its progress entry, read once by the
        caller; else the one there now) and its length, when known."""
        loop = loop or self.progress.get("loop")
        if loop is None:
            return None
        key, iterator, n, _started = loop
        return begun(iterator, n), n or self._counts.get(key)

    def _records(self) -> tuple[int, int]:
        feed = self.progress.get("feed")
        return (feed.records, feed.tokens) if feed is not None else (0, 0)

    def _samples(self, now: float) -> str:
        """Records (or tokens, when batches are sequences) read per second in the running
        group; '' before any."""
        (records, tokens), (records0, tokens0) = self._records(), self._feed_start
        n, unit = (tokens - tokens0, "tokens") if tokens > tokens0 else (records - records0, "samples")
        return f"{human_count(n / max(now - self._epoch_t0, 1e-9))} {unit}/s" if n > 0 else ""

    def _refresh(self) -> None:
        loop = self.progress.get("loop")
        step = self._step(loop)
        latest = dict(self._values)
        shared = self._shared | shared_names(latest)
        values = " ".join(f"{task_label(task, k, shared)}={_fmt(v)}"
                          for (task, k), v in list(latest.items())[-4:])
        now = time.monotonic()
        samples = self._samples(now)
        if self._progress_bar is not None:
            if step is not None:
                done, total = step
                if loop is not self._bar_loop:  # a loop started: its own steps/s and ETA
                    self._bar_loop = loop
                    self._progress_bar.reset(self._bar_task, total=total, completed=done)
                self._progress_bar.update(self._bar_task, completed=done, samples=samples,
                                          values=values, **({"total": total} if total else {}))
            return
        if self._what.startswith("epoch") and step is not None and now - self._last_beat >= self.heartbeat:
            self._last_beat = now
            done, total = step
            rate = done / max(time.perf_counter() - loop[3], 1e-9)
            of = f"/{total}" if total else ""
            self.line(f"  {self._what}: step {done}{of}, {human_count(rate)} steps/s, "
                      + (f"{samples}, " if samples else "")
                      + f"{now - self._epoch_t0:.0f}s" + (f", {values}" if values else ""))

    def _remember_counts(self) -> None:
        """The steps each loop of the epoch that ended ran (the loops of other groups are
        forgotten); the executor's dict is emptied in place, as it holds the same one."""
        loops = self.progress.setdefault("loops", {})
        if self._what.startswith("epoch"):
            for key, (_key, iterator, n, _started) in list(loops.items()):
                self._counts[key] = begun(iterator, n)
        loops.clear()

    # -- console.log --------------------------------------------------------------------------
    def _open_log(self) -> None:
        if self._log_path is None:
            return
        from jobrun import safefs

        try:
            self._log = os.fdopen(safefs.open_write(self._log_path, append=True), "a", buffering=1)
        except OSError as e:
            print(f"warning: cannot write {self._log_path} ({e.strerror or e}); the console is "
                  "not copied there", file=sys.stderr, flush=True)

    def _close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            with suppress(OSError):
                log.close()


def _progress_bar() -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class StepsPerSecond(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{human_count(speed)} steps/s", style="progress.data.speed")

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), StepsPerSecond(),
        TextColumn("{task.fields[samples]}", style="progress.data.speed"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[values]}"),
        refresh_per_second=5, transient=True,
    )


def _true(value: Any) -> bool:
    from jobrun.ops.core import truthy

    try:
        return truthy(value)
    except Exception:  # noqa: BLE001 - a value without one truth value is shown
        return True


def _fmt(value: Any) -> str:
    from jobrun.ops.core import plain

    v = plain(value)
    if v is None:  # not measured this epoch: `-`, as `jobrun ckpt list` and `jobrun runs` show it
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 4:
        return f"<{len(v)} items>"
    return str(v).lower() if isinstance(v, bool) else str(v)


def human_count(x: float) -> str:
    """A rate as people read it, to 3 significant digits: 107340 -> '107k', 42817 -> '42.8k',
    1.2e6 -> '1.2M', 3.071 -> '3.07' (never e-notation: 1.07e+05 is read twice)."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    x = float(f"{x:.3g}")  # rounded first: 999.7 is '1k', not '1e+03'
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def human_size(n: float) -> str:
    """1536 -> '1.5 KB' (binary units, as `ls -h`)."""
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def shared_names(keys: Iterable[tuple[str | None, str]]) -> set[str]:
    """The names that more than one task gave (logged or output) among (task, name) keys:
    each is shown as :func:`task_label` says (the epoch line, the progress bar, `jobrun plot`)."""
    tasks: dict[str, set[str | None]] = {}
    for task, name in keys:
        tasks.setdefault(name, set()).add(task)
    return {name for name, given in tasks.items() if len(given) > 1}


def task_label(task: str | None, name: str, shared: Container[str]) -> str:
    """A value's name as shown: `task.name` when two tasks give the name (train.loss,
    finetune.loss), else the name alone."""
    return f"{task}.{name}" if task is not None and name in shared else name
