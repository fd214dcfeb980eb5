"""SIGINT/SIGTERM/SIGUSR1 while jobrun starts.

A KeyboardInterrupt raised while a C extension initialises (torch takes about a second to
import, far more on a loaded machine) can crash the interpreter (SIGSEGV, or abort in
pybind11). So from the moment the CLI module is imported, a signal is only remembered;
:func:`interruptible` is called once the heavy imports are done, and from then on a signal
raises :class:`Interrupted` (the job runner installs its own handler, which also lets a
checkpoint save finish first).

`train` and `resume` check everything they can before they import torch, and until they
write into the run directory a signal ends them at once (:func:`exit_at_once`): nothing is
written yet, so there is nothing to keep, and os._exit unwinds nothing a half-imported
extension could trip on.

SIGUSR1 (SLURM's warning before it preempts or times out a job, `--signal=USR1@90`) stops
a job as SIGTERM does: a checkpoint state that resumes exactly, status interrupted, exit
128+10 = 138.

With replicas, a signal is acted on where every rank agrees to stop (see below).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_pending: list[int] = []


def _remember(signum: int, frame: Any) -> None:
    _pending.append(signum)


_finished: list[bool] = []  # the job of this command finished: a signal now comes while it closes
CLOSING = "closing, after the job finished"
_phase = ["start-up"]  # what a signal interrupts before a job runs ("": a command that runs none)


def _raise(signum: int, frame: Any) -> None:
    from jobrun.errors import Interrupted

    raise Interrupted(signum, during=CLOSING if _finished else _phase[0])


def _exit_now(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    said = (f"interrupted during {CLOSING} ({name}); the run is finished, as run.json says" if _finished
            else f"interrupted during start-up ({name}); nothing was written")
    os.write(2, f"{said}\n".encode())
    os._exit(128 + signum)


def job_finished() -> None:
    """The job finished (run.json says so): a signal from now on says that it came while
    the process closed, not during start-up with "nothing was written"."""
    _finished[:] = [True]


def exit_at_once() -> None:
    """Until :func:`interruptible`: a signal ends the process at once (nothing is written
    yet); one that came while deferred ends it now."""
    _finished.clear()
    _phase[0] = "start-up"
    if _swap((_remember, _raise), _exit_now) and _pending:
        _exit_now(_pending[0], None)


def end_start_up() -> None:
    """A command that stopped before :func:`interruptible` (a refused plan) leaves a
    signal raising Interrupted, not ending the process, for whatever runs next in this
    process (the tests invoke many commands in one)."""
    _phase[0] = "start-up"
    _swap((_exit_now,), _raise)


def import_torch() -> None:
    """Import torch (a second or more) while a signal still ends the process at once."""
    import torch  # noqa: F401


def defer() -> None:
    """Remember SIGINT/SIGTERM/SIGUSR1 instead of acting on them (a signal the shell set to be
    ignored, as for a background job, stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _remember)


def interruptible(phase: str = "start-up") -> None:
    """From now on a signal raises Interrupted; one that came while deferred raises now.
    ``phase``: what it interrupts until a job runs; "" for a command that runs no job
    (`runs`, `ckpt verify`: "interrupted (SIGINT)", not "during start-up")."""
    _phase[0] = phase
    if _swap((_remember, _exit_now), _raise) and _pending:
        _raise(_pending[0], None)


def _swap(old: tuple[Any, ...], new: Any) -> bool:
    """Replace the handlers in ``old`` by ``new`` (the main thread only: False elsewhere;
    a handler of someone else's, or SIG_IGN, stays)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for s in SIGNALS:
        if signal.getsignal(s) in old:
            signal.signal(s, new)
    return True


# -- DataLoader workers ---------------------------------------------------------------
#
# A signal to the whole process group (Ctrl-C; SLURM's USR1 warning and scancel, `kill --
# -PGID`, docker stop) reaches a job's DataLoader workers too, and the job stops them itself.


def end_quietly(signum: int, frame: Any) -> None:
    """A worker's SIGTERM: it ends at once with status 0, which torch does not count as a
    worker's failure (killed by the signal, torch raised "worker is killed by signal" in the
    job from its SIGCHLD handler: a traceback and exit 1 in place of 143)."""
    os._exit(0)


def in_forked_worker(owner: int, signum: int) -> bool:
    """Whether the job's handler runs in a process forked from ``owner``: a worker that
    did not replace the handlers it inherited yet (it is starting). It acts as a worker
    does (SIGTERM: :func:`end_quietly`; the others: nothing)."""
    if os.getpid() == owner:
        return False
    if signum == signal.SIGTERM:
        end_quietly(signum, None)
    return True


def expect_worker_deaths() -> None:
    """A stop signal came: workers killed by it (before their own handlers were set, torch's
    C handler lets a SIGTERM from anyone but their parent kill them) die as part of the stop.
    torch's SIGCHLD handler would raise each death in whatever the job runs next (its stop,
    atexit); the job shuts its workers down itself. Main thread only."""
    handler = signal.getsignal(signal.SIGCHLD)
    if getattr(handler, "__module__", "").startswith("torch.utils.data"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


# -- a stop the ranks of a data-parallel job agree on ------------------------------------
#
# A rank that raised at once on SIGINT would leave the others waiting for it in their next
# collective. So with replicas a signal is only remembered (request); its flag rides on
# collectives every rank passes together (train.step's gradient all-reduce, under fsdp its
# first reduce-scatter of gradients; one all-reduce after each save), and every rank
# raises at the same one (agree). A rank that meets no such point within GRACE_S (a long
# init, download or exit) stops where it is: the others got the signal too (from the
# terminal or the launcher) and do the same.

GRACE_S = 2.0  # below torch's elastic agent's 5 s before it SIGKILLs its workers
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's: the ranks stop as for SIGTERM
_SIGTERM_WEIGHT = 4096.0  # flags of up to 4095 ranks add up exactly in a float32
_requested: list[int] = []
_timer: list[threading.Timer] = []


def request(signum: int) -> bool:
    """Remember a signal for the ranks to agree on; True once it is overdue (GRACE_S
    after the first one, when the runner should stop where it is)."""
    import _thread

    if not _requested:
        _requested.append(signum)
        timer = threading.Timer(GRACE_S, _thread.interrupt_main, (signum,))
        timer.daemon = True
        timer.start()
        _timer.append(timer)
        return False
    return bool(_timer) and not _timer[0].is_alive()


def requested() -> int:
    """The signal this process got and has not acted on yet (0: none)."""
    return _requested[0] if _requested else 0


def flag() -> float:
    """This rank's stop flag, to be summed over ranks and given to :func:`agree`."""
    sig = requested()
    return 0.0 if not sig else _SIGTERM_WEIGHT if sig in STOP_SIGNALS else 1.0


def agree(total: float) -> None:
    """Raise Interrupted when the flags summed over ranks say some rank was signalled
    (SIGTERM when any rank got one, else SIGINT): every rank raises the same."""
    if total <= 0:
        return
    from jobrun.errors import Interrupted

    reset()
    raise Interrupted(signal.SIGTERM if total >= _SIGTERM_WEIGHT else signal.SIGINT)


def disarm() -> None:
    """No stop where it is any more (the job is over); the signal stays :func:`requested`."""
    for timer in _timer:
        timer.cancel()
    _timer.clear()


def reset() -> None:
    disarm()
    _requested.clear()


# -- a spawned worker's launcher ----------------------------------------------------------
#
# torch's spawned workers get SIGINT when their parent dies (their parent-death signal):
# a launcher killed with kill -9 stops its ranks as a Ctrl-C would, and they say why. The
# ranks the launcher starts are forked by its fork server (jobrun.runner.forkserver),
# which is their parent and lives as long as they do: a rank watches the launcher itself,
# through a pidfd, and sends itself that SIGINT when it dies. Where there is no pidfd the
# ranks are spawned by the launcher, their parent.

_launcher: list[Any] = []  # [its pid, a pidfd of it or None: it is the parent]
LAUNCHER_GONE = "the launcher went away (killed?), and the ranks stopped with it"


def watch_launcher(pid: int) -> None:
    """Remember this worker's launcher (process ``pid``); when it is not the parent, a
    thread sends this process SIGINT when it ends, as a parent's death would."""
    fd = None
    if pid != os.getppid():
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already: stop as if it went now
            _launcher[:] = [pid, None]
            os.kill(os.getpid(), signal.SIGINT)
            return
    _launcher[:] = [pid, fd]
    if fd is not None:
        threading.Thread(target=_on_death, args=(fd,), name="jobrun-launcher-watch", daemon=True).start()


def _on_death(fd: int) -> None:
    import select

    select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGINT)


def _gone() -> bool:
    pid, fd = _launcher
    if fd is None:
        return os.getppid() != pid
    import select

    return bool(select.select([fd], [], [], 0)[0])


def orphaned() -> bool:
    """Whether the launcher this worker remembered is gone. A while is given: the ranks
    may act on the launcher's death (its sockets closed) before the kernel tells them it
    ended; a Ctrl-C waits 0.2 s more for its answer."""
    import time

    for _ in range(10):
        if not _launcher or _gone():
            return bool(_launcher)
        time.sleep(0.02)
    return False


@contextmanager
def meeting(say: bool, every: float = 0.1) -> Iterator[None]:
    """While this worker meets the other ranks (it builds the process group, having
    written nothing): leave at once, with os._exit, if the launcher goes away. Its SIGINT
    could not stop it there: a rank connecting to the rendezvous store the launcher held
    retried in C++, where no handler runs, for JOBRUN_DIST_TIMEOUT (300 s), and the fork
    server and the resource tracker lived as long. A rank whose wait in that store broke
    as it went leaves the same way (it printed torch's traceback). Nothing is saved yet,
    so nothing is left to finish; ``say``: this rank prints why (rank 0)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every):
            if _gone():
                _leave_orphaned(say)

    if _launcher:
        threading.Thread(target=watch, name="jobrun-meeting-watch", daemon=True).start()
    try:
        yield
    except BaseException:
        if orphaned():
            _leave_orphaned(say)
        raise
    finally:
        done.set()


def _leave_orphaned(say: bool) -> None:
    if say:
        from jobrun.errors import Interrupted

        stopped = Interrupted(signal.SIGINT, during="start-up", why=LAUNCHER_GONE)
        os.write(2, f"{stopped.format_message()}\n".encode())
    os._exit(128 + signal.SIGINT)


def exit_when_orphaned(code: int, every: float = 0.5) -> None:
    """After its job: leave with ``code`` if the launcher goes away. torch's wrapper of a
    spawned worker waits, without a timeout, for its launcher to say it may exit; a
    launcher killed then (kill -9 after the job ended) left its ranks waiting for good,
    each holding its memory (found: two ranks of 550 MB each, 23 minutes on)."""
    import time

    def watch() -> None:
        while _launcher and not _gone():
            time.sleep(every)
        os._exit(code)

    if _launcher:
        threading.Thread(target=watch, name="jobrun-orphan-watch", daemon=True).start()
