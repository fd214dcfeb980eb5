"""What a person sees while a job runs.

On a terminal: a rich live status line (job, group, epoch, elapsed) above which the
epoch summaries scroll. Elsewhere (logs, CI, pipes): the same summaries as plain lines.
Only rank 0 shows anything.
"""

from __future__ import annotations

import sys
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
        self._t0 = time.monotonic()

    @contextmanager
    def live(self, job: str):
        self._job = job
        self._t0 = time.monotonic()
        if not (self.enabled and self.tty):
            yield self
            return
        from rich.console import Console

        self._console = Console()
        with self._console.status(f"[bold]{job}[/] starting") as status:
            self._status = status
            try:
                yield self
            finally:
                self._status = None

    def status(self, what: str) -> None:
        if self._status is not None:
            elapsed = time.monotonic() - self._t0
            self._status.update(f"[bold]{self._job}[/] {what}  [dim]{elapsed:,.1f}s[/]")

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
