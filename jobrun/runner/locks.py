"""The locks jobrun holds while a run writes: the run directory's and the checkpoint
directory's (each a `.lock` file of jobrun's own, flock'ed, naming its holder)."""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from jobrun import safefs
from jobrun.errors import JobrunError
from jobrun.safedel import Shape, remove_in

_held_locks: set[int] = set()  # the run locks this process holds (their fds)


def _drop_locks_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copy of the run lock's fd: the
    flock belongs to the open file, so a child outliving a killed job (a worker notices
    its parent died a few seconds later) would keep the run locked. The parent's own
    fd keeps the lock held while it runs."""
    for fd in _held_locks:
        with suppress(OSError):
            os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_drop_locks_in_child)
_held_paths: set[str] = set()  # the lock files this process holds


def holder(path: Path) -> str | None:
    """Who holds the lock file ``path`` (what it says), without taking it; None when no
    other process does (or there is no such regular file)."""
    if os.path.abspath(path) in _held_paths:
        return None
    try:
        fd = safefs.open_read(path)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return os.read(fd, 512).decode(errors="replace").strip() or "another process"
        return None
    finally:
        os.close(fd)  # also releases the shared flock


@contextmanager
def hold_lock(path: Path, me: str, busy: Callable[[str], JobrunError], optional: bool = False) -> Iterator[None]:
    """An exclusive flock on the lock file ``path`` (jobrun's own: opened without following
    a link, regular files only) while the block runs; it says ``me`` to whoever finds it
    held, and ``busy(holder)`` is raised when another process holds it. ``optional``: a
    lock file that cannot be created (a read-only or missing place, not a planted link or
    FIFO) is no lock, and no error."""
    from jobrun.runner.rundir import _write_error as write_error

    while True:
        try:
            fd = safefs.open_lock(path)
        except OSError as e:
            if optional and not isinstance(e, safefs.UnsafeFile):
                yield  # nothing can be written there either (the writes say so)
                return
            raise write_error(path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise busy(holder) from None
        if _still_at(fd, path):
            break
        os.close(fd)  # its holder removed it as it let go (drop_lonely_lock): take the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        _held_locks.add(fd)
        _held_paths.add(os.path.abspath(path))
        yield
    finally:
        _held_paths.discard(os.path.abspath(path))
        _held_locks.discard(fd)
        os.close(fd)  # also releases the flock


def _still_at(fd: int, path: Path) -> bool:
    """Whether the file ``fd`` locks is still the one at ``path``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


@contextmanager
def hold_dir_lock(path: Path, me: str, busy: Callable[[str], JobrunError]) -> Iterator[None]:
    """hold_lock on the lock file ``path`` (optional), its directory made first when
    missing. A lock that guarded nothing (its directory holds nothing else as the block
    ends: a run that failed before its first save there) is removed as it is let go, with
    the directories made for it, so that nothing is left where nothing was written."""
    made, d = [], path.parent
    while not d.exists() and d != d.parent:
        made.append(d)
        d = d.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        yield  # no checkpoint can be written there: each save says so, training goes on
        return
    try:
        with hold_lock(path, me, busy, optional=True):
            try:
                yield
            finally:
                with suppress(OSError):
                    if os.listdir(path.parent) == [path.name]:  # unlinked while held: see hold_lock
                        remove_in(path.parent, Shape(files=re.compile(re.escape(path.name))), [path.name])
    finally:
        for d in made:  # innermost first; one that holds anything stays
            with suppress(OSError):
                remove_in(d.parent, Shape(dirs=((re.compile(re.escape(d.name)), Shape()),)), [d.name])
