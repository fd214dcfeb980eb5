"""One rank's checkpoint directory: its layout, and how it is written atomically.

Layout::

    <ckpt_dir>/<node>.<E>/rank-<r>/
        tensors.safetensors   every tensor of the workspace (see codec), by the safetensors library
        values.json           everything else, as JSON
        MANIFEST.json         format, version, node, epoch, rank, world_size, created, meta,
                              and per file its size and the CRC-32 of each 16 MiB chunk
        COMMIT                {"manifest_sha256": ..., node, epoch, rank, world_size}

A save writes everything into a temporary directory, renames it into place, and writes
COMMIT last, so a crash at any point leaves either the previous state or something that
is never reported valid (see read.py for what valid means).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from jobrun import hints, safefs
from jobrun.errors import CheckpointError
from jobrun.safedel import Shape, remove_in
from jobrun.safefs import fsync_dir
from jobrun.store import tensorfile
from jobrun.store.codec import UnsupportedValue, encode

FORMAT = "jobrun-checkpoint"
FORMAT_VERSION = 3  # a CRC-32 per chunk of each file; 1 and 2 (SHA-256) are refused
VALUES_VERSION = 1
CHUNK_BYTES = 16 << 20  # a file's checksum is one CRC-32 per this many bytes
TENSORS_FILE = "tensors.safetensors"
VALUES_FILE = "values.json"
MANIFEST_FILE = "MANIFEST.json"
COMMIT_FILE = "COMMIT"
DATA_FILES = (TENSORS_FILE, VALUES_FILE)

_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_RANK_DIR_RE = re.compile(r"rank-(0|[1-9][0-9]*)")

T = TypeVar("T")

# What a save writes, for the one delete (jobrun.safedel): in a rank directory its files
# and a COMMIT marker being written; in an epoch directory the rank directories and what
# place_dir and _drop_ranks_beyond leave there (a temporary copy, an old copy moved
# aside, a rank renamed away); in the checkpoint directory the epochs of the plan's nodes
# and epochs renamed away by a prune. Nothing else there is jobrun's.
_RANK_FILES = re.compile(  # .tmpXXXXXX: what the safetensors library writes, then renames
    r"tensors\.safetensors|values\.json|MANIFEST\.json|COMMIT|\.COMMIT\.tmp-(?:\d+-)?[0-9a-f]{8}"
    r"|\.tmp[A-Za-z0-9_]{3,12}")


def _has_manifest(dir_fd: int) -> bool:
    """Whether the directory holds a checkpoint manifest (regular file, ours by format)."""
    try:
        fd = os.open(MANIFEST_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 4096)
    except OSError:
        return False
    finally:
        os.close(fd)
    return re.search(rb'"format"\s*:\s*"' + FORMAT.encode() + rb'"', head) is not None


# A rank directory in place is jobrun's when its manifest says so; one being written or
# renamed away (a kill may have cut it short before the manifest) by its name alone.
RANK_SHAPE = Shape(files=_RANK_FILES, record=_has_manifest, last=frozenset({MANIFEST_FILE}))
_RANK_LEFTOVER_SHAPE = Shape(files=_RANK_FILES)
EPOCH_SHAPE = Shape(dirs=((re.compile(r"rank-(?:0|[1-9][0-9]*)"), RANK_SHAPE),
                          (re.compile(r"\.(?:tmp|old)-rank-\d+-\d+-[0-9a-f]{8}|\.deleting-rank-\d+-[0-9a-f]{8}"),
                           _RANK_LEFTOVER_SHAPE)))


def checkpoint_dir_shape(nodes: Iterable[str] | None = None) -> Shape:
    """What jobrun writes in a checkpoint directory: the epochs of ``nodes`` (of any node
    when None), and those a prune renamed away (``.deleting-<node>.<epoch>-<hex>``)."""
    node = "|".join(re.escape(check_node(n)) for n in nodes) if nodes is not None else _NODE_RE.pattern
    epoch = rf"(?:{node or '(?!)'})\.(?:0|[1-9][0-9]*)"
    return Shape(dirs=((re.compile(rf"{epoch}|\.deleting-{epoch}-[0-9a-f]{{8}}"), EPOCH_SHAPE),))


# ---------------------------------------------------------------------------- names


def check_node(node: Any) -> str:
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node) or ".." in node:
        raise CheckpointError(
            f"bad node name {node!r} for a checkpoint",
            hint="node names are 1-64 letters, digits, '_', '.' or '-', start with a letter "
            "or digit, and contain no '..'",
        )
    return node


def check_count(what: str, n: Any) -> int:
    if type(n) is not int or n < 0:
        raise CheckpointError(f"bad checkpoint {what} {n!r}: a non-negative int is needed")
    return n


def epoch_dir(ckpt_dir: str | os.PathLike[str], node: str, epoch: int) -> Path:
    """``<ckpt_dir>/<node>.<epoch>``, after checking that the names are safe."""
    check_node(node)
    check_count("epoch", epoch)
    return Path(ckpt_dir) / f"{node}.{epoch}"


def rank_dir(ckpt_dir: str | os.PathLike[str], node: str, epoch: int, rank: int = 0) -> Path:
    """``<ckpt_dir>/<node>.<epoch>/rank-<rank>``, after checking that the names are safe."""
    return epoch_dir(ckpt_dir, node, epoch) / f"rank-{check_count('rank', rank)}"


def ranks_in(path: Path) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _RANK_DIR_RE.fullmatch(n)))


def missing_rank(edir: Path, rank: int) -> str:
    found = ", ".join(map(str, ranks_in(edir))) or "none"
    return f"{edir}: rank {rank} is missing (ranks found: {found})"


# ---------------------------------------------------------------------------- saving


@dataclass
class Prepared:
    """A workspace ready to be written: encoded, its tensors on the CPU."""

    tensors: dict[str, Any]
    values_json: bytes
    meta: dict[str, Any]
    tensor_bytes: int
    skipped: list[str] = field(default_factory=list)  # blobs left out (UnsupportedValue)
    private: bool = True  # the tensors are copies (prepare(copy=True)), not live memory


@dataclass(frozen=True)
class SaveResult:
    path: Path  # the rank directory
    bytes: int  # all files written
    seconds: float


def prepare(
    blobs: dict[str, Any],
    meta: dict[str, Any] | None = None,
    *,
    copy: bool = True,
    reuse: Prepared | None = None,
    on_unsupported: Callable[[UnsupportedValue], None] | None = None,
) -> Prepared:
    """Encode a workspace for :func:`write`.

    With ``copy=True`` (the default) every tensor is copied to private CPU memory, so
    training may go on mutating the live tensors while another thread writes. ``reuse``,
    an earlier Prepared whose ``write`` has finished, lends its copies' memory to this
    one when the shapes and dtypes match; that one must not be written again. A blob
    that cannot be stored raises UnsupportedValue, or is passed to ``on_unsupported``
    and left out (its name is then in ``Prepared.skipped``). ``meta`` must be JSON-able.
    """
    skipped: list[str] = []

    def skip(e: UnsupportedValue) -> None:
        skipped.append(e.blob)
        on_unsupported(e)  # type: ignore[misc]

    lend = reuse.tensors if reuse is not None and reuse.private and copy else None
    tree, tensors = encode(
        blobs, copy=copy, reuse=lend, on_unsupported=skip if on_unsupported else None
    )
    values = {"format": "jobrun-values", "version": VALUES_VERSION, "blobs": tree}
    meta = dict(meta or {})
    try:
        json.dumps(meta, allow_nan=False)
        values_json = json.dumps(values, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint data is not JSON-serializable: {e}") from e
    total = sum(int(t.nbytes) for t in tensors.values())
    return Prepared(tensors, values_json, meta, total, skipped, private=copy)


def save(
    blobs: dict[str, Any],
    meta: dict[str, Any] | None,
    ckpt_dir: str | os.PathLike[str],
    node: str,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    *,
    on_unsupported: Callable[[UnsupportedValue], None] | None = None,
) -> SaveResult:
    """``prepare`` then ``write``, without the private copies (training waits anyway)."""
    _check_ids(node, epoch, rank, world_size)
    prepared = prepare(blobs, meta, copy=False, on_unsupported=on_unsupported)
    return write(prepared, ckpt_dir, node, epoch, rank, world_size)


def write(
    prepared: Prepared,
    ckpt_dir: str | os.PathLike[str],
    node: str,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
) -> SaveResult:
    """Write a prepared workspace as ``<ckpt_dir>/<node>.<epoch>/rank-<rank>``, atomically.

    Safe to call from another thread than the one training. A failure removes every
    temporary and raises CheckpointError; a re-save of an existing epoch replaces it only
    once the new one is complete. Other epochs are never touched.
    """
    _check_ids(node, epoch, rank, world_size)
    start = time.perf_counter()
    final = rank_dir(ckpt_dir, node, epoch, rank)
    ids = {"node": node, "epoch": epoch, "rank": rank, "world_size": world_size}

    def fill(tmp: Path) -> tuple[int, bytes]:
        size, digests = tensorfile.write(tmp / TENSORS_FILE, prepared.tensors, CHUNK_BYTES)
        values = prepared.values_json
        files = {
            TENSORS_FILE: _entry(size, digests),
            VALUES_FILE: _entry(
                _write_file(tmp / VALUES_FILE, values),
                tensorfile.checksum_bytes(values, CHUNK_BYTES),
            ),
        }
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **ids,
            "created": time.time(),
            "seconds": round(time.perf_counter() - start, 6),
            "tensor_bytes": prepared.tensor_bytes,
            "skipped": list(prepared.skipped),
            "meta": prepared.meta,
            "files": files,
        }
        raw = json.dumps(manifest, indent=1, allow_nan=False).encode()
        return size + len(values) + _write_file(tmp / MANIFEST_FILE, raw), raw

    def commit(written: tuple[int, bytes]) -> None:
        marker = {"manifest_sha256": hashlib.sha256(written[1]).hexdigest(), **ids}
        # The writer's pid in the name: `clean` leaves the files of a live writer alone.
        tmp = final / f".{COMMIT_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            _write_file(tmp, json.dumps(marker).encode())
            os.replace(tmp, final / COMMIT_FILE)
        except BaseException:
            with contextlib.suppress(OSError):
                remove_in(final, RANK_SHAPE, [tmp.name])
            raise
        fsync_dir(final)

    try:
        size, _ = place_dir(final, fill, commit)
    except OSError as e:
        raise write_error(e, final, Path(ckpt_dir)) from e
    size += (final / COMMIT_FILE).stat().st_size
    if rank == 0:
        _drop_ranks_beyond(final.parent, world_size)
    return SaveResult(final, size, time.perf_counter() - start)


def _drop_ranks_beyond(edir: Path, world_size: int) -> None:
    """Rank directories an earlier save of this epoch by more ranks left (a resume with
    fewer replicas that saves the epoch again): they would make it two checkpoints in one."""
    for r in ranks_in(edir):
        if r >= world_size:
            stale = edir / f"rank-{r}"
            gone = edir / f".deleting-rank-{r}-{secrets.token_hex(4)}"
            with contextlib.suppress(OSError):
                os.replace(stale, gone)
                remove_in(edir, EPOCH_SHAPE, [gone.name])


def _check_ids(node: Any, epoch: Any, rank: Any = 0, world_size: Any = 1) -> None:
    check_node(node)
    check_count("epoch", epoch)
    check_count("rank", rank)
    if type(world_size) is not int or not 0 <= rank < world_size:
        raise CheckpointError(f"bad rank {rank!r} for world size {world_size!r}")


def _entry(size: int, digests: list[str]) -> dict[str, Any]:
    """A data file's line in the manifest."""
    return {"size": size, "chunk_bytes": CHUNK_BYTES, "crc32_chunks": digests}


def _create(path: Path) -> Any:
    """A new file for writing, unbuffered (created exclusively, never through a link)."""
    return os.fdopen(safefs.create_new(path), "wb", buffering=0)


def _write_file(path: Path, data: bytes) -> int:
    """Write and fsync a new file; its size."""
    with _create(path) as f:
        view = memoryview(data)
        while view:
            view = view[f.write(view) :]
        os.fsync(f.fileno())
    return len(data)


def make_dirs(path: Path) -> None:
    """mkdir -p, fsyncing the parent of every directory created (so the entry lasts)."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:  # another rank made it meanwhile
            continue
        fsync_dir(d.parent)


def place_dir(final: Path, fill: Callable[[Path], T], then: Callable[[T], None]) -> T:
    """Make the directory ``final`` atomically; what ``fill`` returned.

    ``fill`` writes a new temporary directory beside ``final``, which is then renamed
    over it (an existing one is moved aside first and deleted only at the very end),
    and ``then`` runs (a COMMIT marker). On any error everything written is removed and
    the old directory put back, and the error propagates. ``final`` is a rank directory
    (of an epoch, or of an upload): what is deleted is what a save writes there, and the
    parent (the epoch's directory) once nothing else is in it: a failed save of a new
    epoch leaves no trace, which `ckpt list` and resume would call invalid. With replicas
    whichever rank fails last removes it (all fail on a full disk; the rank that made it
    may fail while another's temporary directory is still there).
    """
    parent = final.parent
    tag = f"{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp, aside = parent / f".tmp-{tag}", parent / f".old-{tag}"
    made = placed = had_old = False
    try:
        make_dirs(parent)
        if os.path.islink(parent):  # jobrun makes this directory: a link there is planted
            raise OSError(errno.ELOOP, f"{parent} is a symlink; jobrun does not write through it", str(parent))
        if not _replaceable_dir(final):
            raise OSError(errno.EEXIST, f"{final} holds files jobrun did not write", str(final))
        try:
            os.mkdir(tmp)
        except FileNotFoundError:  # another rank's failed save removed it, empty, meanwhile
            make_dirs(parent)
            os.mkdir(tmp)
        made = True
        result = fill(tmp)
        fsync_dir(tmp)
        if final.exists():
            os.replace(final, aside)
            had_old = True
        os.replace(tmp, final)
        placed = True
        fsync_dir(parent)
        then(result)
    except BaseException:
        _discard(tmp if made and not placed else None)
        _discard(final if placed else None)
        if had_old:  # on failure the old copy stays aside (hidden) rather than half-restored
            with contextlib.suppress(OSError):
                os.replace(aside, final)
        with contextlib.suppress(OSError):  # kept whole when another rank's save is there
            remove_in(parent.parent, Shape(dirs=((re.compile(re.escape(parent.name)), Shape()),)),
                      [parent.name])
        raise
    _discard(aside if had_old else None)
    return result


def _replaceable_dir(final: Path) -> bool:
    """Whether ``final`` may be moved aside and deleted: missing, a link (moved, never
    followed), empty, or a save of jobrun's by its manifest."""
    try:
        fd = os.open(final, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError as e:
        return e.errno == errno.ELOOP
    try:
        return _has_manifest(fd) or not os.listdir(fd)
    finally:
        os.close(fd)


def damaged_save(final: Path) -> bool:
    """Whether the rank directory ``final`` is one a save may not replace (its manifest
    does not say it is jobrun's) although it holds only files a save writes, all regular:
    a save of jobrun's whose manifest was damaged. A resume that trains its epoch again
    moves it aside first, kept; a directory holding any other name is the user's and
    stays where it is (the save then fails, naming it)."""
    if _replaceable_dir(final):
        return False
    try:
        with os.scandir(final) as entries:
            return all(RANK_SHAPE.owns_file(e.name) and e.is_file(follow_symlinks=False) for e in entries)
    except OSError:
        return False


def _discard(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            remove_in(path.parent, EPOCH_SHAPE, [path.name])


def write_error(e: OSError, target: Path, where: Path) -> CheckpointError:
    """A CheckpointError telling what failed, where, and how to fix it."""
    code = errno.errorcode.get(e.errno or 0, "")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device"
        hint = f"free disk space where {where} is, or set checkpoint.dir to a larger disk"
    elif e.errno in (errno.EACCES, errno.EPERM):
        what, hint = "permission denied", f"make {where} writable, or set checkpoint.dir"
    elif e.errno == errno.EROFS:
        what, hint = "read-only file system", f"make {where} writable, or set checkpoint.dir"
    elif e.errno == errno.EEXIST:  # a damaged checkpoint of that epoch, or the user's files
        what = f"{e.strerror or e}"
        hint = (f"a damaged checkpoint (see `{hints.command('ckpt list')}`) or files of yours are in the way: "
                f"move {e.filename or target} away to let this epoch be saved")
    else:
        what = f"{e.strerror or e}" + (f" ({code})" if code else "")
        hint = f"check the disk holding {where}, or set checkpoint.dir"
    at = f" ({e.filename})" if e.filename and str(e.filename) != str(target) else ""
    return CheckpointError(f"{what} while writing {target}{at}", hint=hint)
