"""Deleting what jobrun wrote, and nothing else.

Every delete jobrun does (``train --overwrite``, pruning old checkpoint epochs, the
leftovers of a killed save, an upload's old copy) goes through :func:`remove_in`. It is
told the shape of what jobrun writes in a directory (:class:`Shape`: the names of its
own regular files and of its own subdirectories, each with its shape) and removes those
only. A name jobrun does not write, a symlink, a FIFO, or a directory where jobrun
writes a file is kept, and returned, so that the caller can say what it left.

Nothing is followed: the walk opens every directory below the root relative to its
parent's descriptor with O_NOFOLLOW, so a directory swapped for a symlink meanwhile is
kept, never entered, and no delete can leave the root's tree. The root itself is a path
the caller trusts (the run directory or checkpoint directory the user named); a path
below it that the run's own records give is opened with :func:`open_under`, one component
at a time, without following links either.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# What a walk treats as "someone else's entry": it was swapped for a link or a file
# meanwhile (ELOOP, ENOTDIR), or something was added to it (ENOTEMPTY, EEXIST).
_KEEP_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST)


@dataclass(frozen=True)
class Shape:
    """What jobrun writes in one directory: regular files whose names match ``files``
    and directories whose names match a pattern of ``dirs`` (each of the shape paired
    with it)."""

    files: re.Pattern[str] | None = None
    dirs: tuple[tuple[re.Pattern[str], Shape], ...] = ()
    # A directory of this shape is jobrun's only when its own record says so (given the
    # directory's descriptor): a checkpoint's manifest. Without it, it is kept whole.
    record: Callable[[int], bool] | None = None
    # Deleted after every other file here: the record's own file, so that a directory cut
    # short by a kill is still known as jobrun's by what is left (a tensor file would
    # otherwise stay for good, no longer recognised).
    last: frozenset[str] = frozenset()

    def owns_file(self, name: str) -> bool:
        return self.files is not None and self.files.fullmatch(name) is not None

    def subdir(self, name: str) -> Shape | None:
        for pattern, shape in self.dirs:
            if pattern.fullmatch(name):
                return shape
        return None


def open_under(root: Path, rel: Path | str = "") -> int:
    """A descriptor of the directory ``root``/``rel``: ``root`` as given (a path the user
    named may pass through links), each component of ``rel`` opened without following a
    link. OSError (ELOOP, ENOTDIR) when one of them is not a plain directory."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in Path(rel).parts:
            if part in ("..", "/"):
                raise OSError(errno.EINVAL, f"{rel} leaves {root}")
            if part == ".":
                continue
            child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_in(root: Path | int, shape: Shape, names: Iterable[str] | None = None) -> list[str]:
    """Remove, in the directory ``root`` (a path, or a descriptor from :func:`open_under`),
    the entries ``names`` (every entry when None) that ``shape`` says jobrun writes, with
    what jobrun wrote inside them; a directory is removed once it is empty. Returns what
    was kept, relative to ``root`` (directories end in '/'), in name order. A name that
    is missing is skipped. OSErrors other than a swapped or refilled entry propagate."""
    fd = os.open(root, _DIR_FLAGS) if not isinstance(root, int) else os.dup(root)
    try:
        return _clear(fd, shape, "", names)
    finally:
        os.close(fd)


def _clear(fd: int, shape: Shape, prefix: str, names: Iterable[str] | None) -> list[str]:
    kept: list[str] = []
    for name in sorted(os.listdir(fd) if names is None else set(names), key=lambda n: (n in shape.last, n)):
        if not name or "/" in name or name in (".", ".."):
            raise OSError(errno.EINVAL, f"{name!r} is not a name in a directory")
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        rel = prefix + name
        sub = shape.subdir(name) if stat.S_ISDIR(st.st_mode) else None
        try:
            if stat.S_ISREG(st.st_mode) and shape.owns_file(name):
                # Swapped for a link since the stat: unlink removes the link, not its target.
                os.unlink(name, dir_fd=fd)
            elif sub is not None:
                child = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                try:
                    if sub.record is not None and not sub.record(child) and os.listdir(child):
                        kept.append(rel + "/")  # not ours by its record (empty: nothing to lose)
                        continue
                    inner = _clear(child, sub, rel + "/", None)
                finally:
                    os.close(child)
                kept += inner
                if not inner:
                    os.rmdir(name, dir_fd=fd)
            else:
                kept.append(rel + ("/" if stat.S_ISDIR(st.st_mode) else ""))
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno not in _KEEP_ERRNOS:
                raise
            kept.append(rel)
    return kept


def tmp_name_of(names: str) -> str:
    """The pattern of the temporary names :func:`jobrun.safefs.write_atomic` gives files
    whose names match ``names`` (a file a kill left half written is jobrun's too)."""
    return rf"(?:{names})|\.(?:{names})\.tmp-\d+-[0-9a-f]{{8}}"


def say_kept(kept: list[str], limit: int = 8) -> str:
    """``a, b/, c`` (at most ``limit`` of them, then how many more)."""
    shown = ", ".join(kept[:limit])
    return shown + (f" and {len(kept) - limit} more" if len(kept) > limit else "")


# -- the run's record of files its ops wrote --------------------------------------------------

WRITTEN_FILE = ".jobrun-written"  # one path a line, relative to the run directory
_MAX_WRITTEN = 1 << 20


def record_written(run_dir: Path, path: Path) -> None:
    """Add ``path`` (a file an op wrote, e.g. `save`) to the run's record, when it lies in
    the run directory: `train --overwrite` deletes it then. Written through safefs."""
    from jobrun import safefs

    try:
        rel = path.relative_to(run_dir)
    except ValueError:
        return  # the user's own place, outside the run: never deleted
    if ".." in rel.parts or not rel.parts or not (run_dir / "run.json").is_file():
        return  # an op run outside a jobrun run directory (its run.json) records nothing
    line = str(rel)
    record = run_dir / WRITTEN_FILE
    try:
        if line in _recorded(record):
            return
    except OSError:
        pass
    fd = safefs.open_write(record, append=True)
    try:
        safefs.write_all(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _recorded(record: Path) -> list[str]:
    from jobrun import safefs

    try:
        data = safefs.read_bounded(record, _MAX_WRITTEN)
    except FileNotFoundError:
        return []
    return data[:_MAX_WRITTEN].decode(errors="replace").splitlines()


def remove_recorded(run_dir: Path, keep: Path | None = None) -> None:
    """Delete the regular files the run's record names (never ``keep``), each opened below
    the run directory without following a link; a line that leaves it is ignored."""
    try:
        lines = _recorded(run_dir / WRITTEN_FILE)
    except OSError:
        return  # a link or FIFO planted there: nothing recorded is trusted
    for line in lines:
        rel = Path(line)
        if not line or rel.is_absolute() or ".." in rel.parts or rel.name in ("", "."):
            continue
        if keep is not None and os.path.exists(run_dir / rel) and os.path.samefile(run_dir / rel, keep):
            continue
        try:
            fd = open_under(run_dir, rel.parent)
        except OSError:
            continue  # gone, or reached through a link: not followed
        try:
            remove_in(fd, Shape(files=re.compile(re.escape(rel.name))), [rel.name])
        except OSError:
            pass
        finally:
            os.close(fd)
