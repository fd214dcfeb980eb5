"""How the launcher starts its ranks: forked by multiprocessing's fork server, which has
imported torch and jobrun once for all of them.

With `spawn`, every rank, and every restart of one, was a new interpreter that imported
torch, and torch._dynamo when its optimizer was built: 4-5 s of CPU a rank, paid by all
ranks at once. The fork server imports this module (its preload) and, in it, torch and
jobrun's worker; each rank is forked from it with them imported, and a rank restarted
after a death starts at once. The server imports nothing else and initialises no device,
so what a rank forked from it runs is what a spawned one ran.

The server first leaves the launcher's session. A signal to the terminal's or the
scheduler's process group (Ctrl-C, SLURM's USR1 warning, scancel's TERM) reaches the
launcher, which forwards it to the ranks; reaching the server, it would have killed it.
A rank's parent is the server, which lives as long as its ranks do: a rank watches the
launcher itself (jobrun.signals.watch_launcher).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from contextlib import suppress


def start_method() -> str:
    """`forkserver`, with this module as the server's preload; `spawn` where a rank
    could not watch its launcher (no pidfd: macOS, Linux < 5.3)."""
    import multiprocessing

    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return "spawn"
    multiprocessing.set_forkserver_preload([__name__])
    return "forkserver"


def stop() -> None:
    """Stop the fork server once its ranks have ended, so that the next launch of this
    process (tests; a notebook) forks its ranks from a server with the environment of its
    own start, as spawned ones would have. Given 5 s: a rank that outlived its launch
    keeps the server alive, and the launcher does not wait for it."""
    from multiprocessing import forkserver

    stopper = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stopper is not None:
        thread = threading.Thread(target=stopper, name="jobrun-forkserver-stop", daemon=True)
        thread.start()
        thread.join(5)


def _in_fork_server() -> bool:
    """Whether multiprocessing's fork server is importing this module (its preload)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    with suppress(OSError):
        os.setsid()
    # Registered first, run last: once the atexit handlers ran, the server, asked to stop
    # by stop(), ends without the teardown of an interpreter that imported torch (2 s of
    # CPU on a loaded machine, which every run of replicas and every Ctrl-C waited for).
    atexit.register(os._exit, 0)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    import jobrun.runner.workers  # noqa: F401
