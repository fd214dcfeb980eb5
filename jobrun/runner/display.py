"""What a person sees while a job runs.

On a terminal: a rich live status line (job, group, epoch, elapsed) above which the
epoch summaries scroll. Elsewhere (logs, CI, pipes): the same summaries as plain lines.
Only rank 0 shows anything.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any


class Display:
    def __init__(self, enabled: bool = True, tty: bool | None = None):
        self.enabled = enabled
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._status: Any = None
        self._console: Any = None
        self._job = ""
        self._what = "starting"
        self._t0 = time.monotonic()
        # Written by the executor's loops (task, iteration, count), read by the ticker.
        self.progress: dict[str, Any] = {}

    @contextmanager
    def live(self, job: str):
        self._job = job
        self._t0 = time.monotonic()
        if not (self.enabled and self.tty):
            yield self
            return
        from rich.console import Console

        self._console = Console()
        stop = threading.Event()
        with self._console.status(f"[bold]{job}[/] starting") as status:
            self._status = status
            ticker = threading.Thread(target=self._tick, args=(stop,), daemon=True)
            ticker.start()
            try:
                yield self
            finally:
                stop.set()
                ticker.join()
                self._status = None

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(0.2):
            self._refresh()

    def status(self, what: str) -> None:
        self._what = what
        self.progress.pop("loop", None)
        self._refresh()

    def _refresh(self) -> None:
        status = self._status
        if status is None:
            return
        elapsed = time.monotonic() - self._t0
        loop = self.progress.get("loop")
        where = ""
        if loop is not None:
            task, i, n = loop
            where = f"  task {task}  iteration {i + 1}" + (f"/{n}" if n else "")
        status.update(f"[bold]{self._job}[/] {self._what}{where}  [dim]{elapsed:,.1f}s[/]")

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._console is not None:
            self._console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        if not self.enabled:
            return
        if self._console is not None:
            self._console.print(f"[bold yellow]warning:[/] {text}", highlight=False)
        else:
            print(f"warning: {text}", file=sys.stderr, flush=True)

    def epoch_line(self, result: Any, max_epochs: int | None) -> None:
        of = f"/{max_epochs}" if max_epochs else ""
        outs = " ".join(
            f"{name}={_fmt(value)}" for task in result.outputs.values() for name, value in task.items()
        )
        parts = [f"epoch {result.epoch}{of}", outs, f"{result.seconds:.2f}s", result.ckpt]
        self.line("  ".join(p for p in parts if p))


def _fmt(value: Any) -> str:
    from jobrun.ops.core import plain

    v = plain(value)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 4:
        return f"<{len(v)} items>"
    return str(v).lower() if isinstance(v, bool) else str(v)


def human_size(n: float) -> str:
    """1536 -> '1.5 KB' (binary units, as `ls -h`)."""
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
