"""Opening the files jobrun writes and reads in run and checkpoint directories.

A run directory is data: whoever can write into it can leave a symlink, a FIFO or a hard
link where jobrun expects its own file. So every file jobrun creates, truncates or appends
to there is opened without following a symlink and checked to be a regular file with one
link before a byte is written; a file it reads from a checkpoint must be a regular file
too (a FIFO would block the reader forever), and reads are bounded. Failures are OSErrors
with a message that names the path; callers turn them into their own JobrunError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafeFile(OSError):
    """A path that jobrun will not write through or read from: not a regular file."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _open(path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open without following a final symlink, refusing anything but a plain file.
    A new file gets 0o666 less the umask, as open() and shell redirections give."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, f"{path} is a symlink; jobrun does not follow it") from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise UnsafeFile(errno.ENXIO, f"{path} is a FIFO, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, f"{path} is {_kind(st.st_mode)}, not a regular file")
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise UnsafeFile(errno.EMLINK, f"{path} has {st.st_nlink} hard links; jobrun writes "
                                           "only files of its own")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_write(path: Path, *, append: bool = False, truncate: bool = True) -> int:
    """A descriptor for writing ``path`` (created when missing): appended to, or emptied
    first when ``truncate``. Emptying happens after the checks, never through a link."""
    fd = _open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0))
    if truncate and not append:
        try:
            os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
    return fd


def open_read(path: Path) -> int:
    """A descriptor for reading the regular file ``path`` (a symlink or FIFO is refused)."""
    return _open(path, os.O_RDONLY)


def open_lock(path: Path) -> int:
    """A descriptor for a lock file (read and write, created when missing)."""
    return _open(path, os.O_RDWR | os.O_CREAT)


def create_new(path: Path) -> int:
    """A descriptor for a new file; an existing entry of any kind is an error."""
    return _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def write_all(fd: int, data: bytes | memoryview) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(path: Path) -> None:
    """Refuse to rename over anything but a regular file of ours (or nothing)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(errno.EINVAL, f"{path} is {_kind(st.st_mode)}, not a regular file")


def make_dirs_under(root: Path, path: Path) -> None:
    """``mkdir -p path``, where the directories below ``root`` (a run directory, which
    others may write into) must be real directories, never links: a link planted there
    would take the write elsewhere. A ``path`` outside ``root`` is the user's own place,
    made as given."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        path.mkdir(parents=True, exist_ok=True)
        return
    root.mkdir(parents=True, exist_ok=True)
    d = root
    for part in rel.parts:
        d = d / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(d)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeFile(errno.ENOTDIR, f"{d} is {_kind(st.st_mode)}, not a directory")


def write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` all at once (see :func:`write_with`)."""
    write_with(path, lambda f: write_all(f.fileno(), data), durable=durable)


def write_with(path: Path, fill: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Replace ``path`` with what ``fill`` writes into the file object it is given, all at
    once: the one way jobrun writes a file. A fresh temporary name in the target's
    directory is created exclusively (O_EXCL, O_NOFOLLOW: a link or file planted there
    is never opened), filled, fsynced, then renamed over ``path``, which must be a
    regular file or missing (a reader sees the old or the new content, never a mix).
    A library that writes to a path of its own choosing (matplotlib, safetensors) writes
    to memory first and comes here with the bytes."""
    check_replaceable(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = create_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # ours, made just now; a link swapped in is removed, not followed
        raise
    if durable:
        fsync_dir(path.parent)


def read_bounded(path: Path, limit: int, *, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` + 1 of them (so that a
    caller sees that a file is too big without reading all of it). ``follow``: a symlink
    is followed (a path the user gave), else refused (a file inside a run)."""
    if follow:
        path = Path(os.path.realpath(path))
    fd = _open(path, os.O_RDONLY)
    try:
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
