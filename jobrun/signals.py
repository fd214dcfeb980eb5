"""SIGINT/SIGTERM while jobrun starts.

A KeyboardInterrupt raised while a C extension initialises (torch takes about a second to
import) can crash the interpreter (SIGSEGV, or abort in pybind11). So from the moment the
CLI module is imported, a signal is only remembered; :func:`interruptible` is called once
the heavy imports are done, and from then on a signal raises :class:`Interrupted` (the job
runner installs its own handler, which also lets a checkpoint save finish first).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: list[int] = []


def _remember(signum: int, frame: Any) -> None:
    _pending.append(signum)


def _raise(signum: int, frame: Any) -> None:
    from jobrun.errors import Interrupted

    raise Interrupted(signum, during="start-up")


def defer() -> None:
    """Remember SIGINT/SIGTERM instead of acting on them (a signal the shell set to be
    ignored, as for a background job, stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _remember)


def interruptible() -> None:
    """From now on a signal raises Interrupted; one that came while deferred raises now."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if signal.getsignal(s) is _remember:
            signal.signal(s, _raise)
    if _pending:
        _raise(_pending[0], None)
