"""The checkpoint store: crash-safe, verifiable saves of a workspace per node and rank.

Layout::

    <ckpt_dir>/<node>.<E>/rank-<r>/
        tensors.safetensors   every tensor of the workspace (see codec)
        values.json           everything else, as JSON
        MANIFEST.json         format, node, epoch, rank, world_size, created, meta,
                              and per file its size and the CRC-32 of each chunk
        COMMIT                {"manifest_sha256": ..., node, epoch, rank, world_size}

A rank's save is valid only when COMMIT is present, names the manifest's hash, and
every file has the size and hashes the manifest lists. A save writes everything into a
temporary directory, renames it into place, and writes COMMIT last, so a crash at any
point leaves either the previous state or something that is never reported valid.

A file's checksum is one per ``chunk_bytes`` of it, so that several threads read and
check one file at once. Format version 3 (``"crc32_chunks"``, 16 MiB chunks) uses
CRC-32: the checksums guard against torn writes and damaged disks, not against
tampering (whoever can change a file can rewrite the manifest beside it), and CRC-32
(as in zip and gzip) runs 2.3x faster than SHA-256, which is what lets a verified load
beat torch.load. Versions 2 (``"sha256_chunks"``, a SHA-256 per 64 MiB) and 1
(``"sha256"``, one for the whole file) are still read and verified. COMMIT names the
manifest by its SHA-256.

Reading, listing and verifying never import torch (only ``load`` without ``as_numpy``
does), so ``jobrun ckpt list/show`` stay fast.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from jobrun.errors import CheckpointError
from jobrun.runner.codec import UnsupportedValue, decode, encode
from jobrun.runner.safetensors_io import (
    CHECKSUMS,
    ChunkHasher,
    io_lanes,
    prefault,
    read_header,
    read_safetensors,
    write_safetensors,
)

FORMAT = "jobrun-checkpoint"
FORMAT_VERSION = 3  # 3: a CRC-32 per chunk of each file; 2: a SHA-256 per chunk; 1: per file
VALUES_VERSION = 1
CHUNK_BYTES = 16 << 20  # a file's checksum is one CRC-32 per this many bytes
# Per format version: the manifest key of a file's checksums, their algorithm, the
# pattern of one, and whether there is one per chunk (else one for the whole file).
_CHECKSUMS = {
    3: ("crc32_chunks", "crc32", re.compile(r"[0-9a-f]{8}"), True),
    2: ("sha256_chunks", "sha256", re.compile(r"[0-9a-f]{64}"), True),
    1: ("sha256", "sha256", re.compile(r"[0-9a-f]{64}"), False),
}
TENSORS_FILE = "tensors.safetensors"
VALUES_FILE = "values.json"
MANIFEST_FILE = "MANIFEST.json"
COMMIT_FILE = "COMMIT"
DATA_FILES = (TENSORS_FILE, VALUES_FILE)

_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_EPOCH_DIR_RE = re.compile(r"(?P<node>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})\.(?P<epoch>0|[1-9][0-9]*)")
_RANK_DIR_RE = re.compile(r"rank-(0|[1-9][0-9]*)")
_READ = 4 << 20  # reads when only hashing

_HINT_RESUME = "resume from an earlier epoch (see `jobrun ckpt list`); this one can be deleted"


# ---------------------------------------------------------------------------- names


def _check_node(node: Any) -> str:
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node) or ".." in node:
        raise CheckpointError(
            f"bad node name {node!r} for a checkpoint",
            hint="node names are 1-64 letters, digits, '_', '.' or '-', start with a letter "
            "or digit, and contain no '..'",
        )
    return node


def _check_count(what: str, n: Any) -> int:
    if type(n) is not int or n < 0:
        raise CheckpointError(f"bad checkpoint {what} {n!r}: a non-negative int is needed")
    return n


def _check_ids(node: Any, epoch: Any, rank: Any = 0, world_size: Any = 1) -> None:
    _check_node(node)
    _check_count("epoch", epoch)
    _check_count("rank", rank)
    if type(world_size) is not int or not 0 <= rank < world_size:
        raise CheckpointError(f"bad rank {rank!r} for world size {world_size!r}")


def epoch_dir(ckpt_dir: str | os.PathLike[str], node: str, epoch: int) -> Path:
    """``<ckpt_dir>/<node>.<epoch>``, after checking that the names are safe."""
    _check_node(node)
    _check_count("epoch", epoch)
    return Path(ckpt_dir) / f"{node}.{epoch}"


def rank_dir(ckpt_dir: str | os.PathLike[str], node: str, epoch: int, rank: int = 0) -> Path:
    """``<ckpt_dir>/<node>.<epoch>/rank-<rank>``, after checking that the names are safe."""
    return epoch_dir(ckpt_dir, node, epoch) / f"rank-{_check_count('rank', rank)}"


def _ranks_in(path: Path) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _RANK_DIR_RE.fullmatch(n)))


# ---------------------------------------------------------------------------- saving


@dataclass
class Prepared:
    """A workspace ready to be written: encoded, with private CPU copies of its tensors."""

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


def _nbytes(t: Any) -> int:
    return int(t.nbytes) if hasattr(t, "nbytes") else t.numel() * t.element_size()


class Spares:
    """Host memory made ahead of an asynchronous save, for tensors of given dtype and shape.

    An optimizer creates its state at its first step (Adam: two tensors per parameter),
    so the save after it copies that state into new memory, and new memory is slow to
    touch: the kernel hands it out page by page (0.14 s per 536 MB on 2 CPUs here, three
    times a copy into memory touched before). ``add`` makes (and touches) buffers on a
    background thread while training goes on; ``prepare(..., spares=)`` copies into
    them the tensors that ``reuse`` has no buffer for.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Any, tuple[int, ...]], list[Any]] = {}
        self._thread: threading.Thread | None = None

    def add(self, like: list[tuple[Any, tuple[int, ...]]]) -> None:
        """Make a buffer for each (torch dtype, shape), in the background."""
        self.wait()

        def make() -> None:
            import torch

            for dtype, shape in like:
                t = torch.empty(shape, dtype=dtype)
                if t.numel():
                    prefault(t.view(-1).view(torch.uint8).numpy())
                self._free.setdefault((dtype, tuple(shape)), []).append(t)

        self._thread = threading.Thread(target=make, name="jobrun-spares", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        """A buffer of this dtype and shape, or None."""
        self.wait()
        free = self._free.get((dtype, tuple(shape)))
        return free.pop() if free else None

    def clear(self) -> None:
        """Drop the buffers not taken."""
        self.wait()
        self._free.clear()

    def __len__(self) -> int:
        self.wait()
        return sum(map(len, self._free.values()))


def prepare(
    blobs: dict[str, Any],
    meta: dict[str, Any] | None = None,
    *,
    copy: bool = True,
    reuse: Prepared | None = None,
    spares: Spares | None = None,
    on_unsupported: Callable[[UnsupportedValue], None] | None = None,
) -> Prepared:
    """Encode a workspace for :func:`write`.

    With ``copy=True`` (the default) every tensor is copied to private CPU memory, so
    training may go on mutating the live tensors while another thread writes. ``reuse``,
    an earlier Prepared whose ``write`` has finished, lends its copies' memory to this
    one (new memory is slow to touch: a page fault per 4 KiB); that one must not be
    written again. ``spares`` lends buffers made ahead to the copies that find none in
    ``reuse``. A blob that cannot be stored raises UnsupportedValue, or is passed to
    ``on_unsupported`` and left out (its name is then in ``Prepared.skipped``). ``meta``
    must be JSON-able.
    """
    skipped: list[str] = []

    def skip(e: UnsupportedValue) -> None:
        skipped.append(e.blob)
        on_unsupported(e)  # type: ignore[misc]

    lend = reuse.tensors if reuse is not None and reuse.private and copy else None
    tree, tensors = encode(
        blobs,
        copy=copy,
        reuse=lend,
        spares=spares if copy else None,
        on_unsupported=skip if on_unsupported else None,
    )
    values = {"format": "jobrun-values", "version": VALUES_VERSION, "blobs": tree}
    meta = dict(meta or {})
    try:
        json.dumps(meta, allow_nan=False)
        values_json = json.dumps(values, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint data is not JSON-serializable: {e}") from e
    total = sum(_nbytes(t) for t in tensors.values())
    return Prepared(tensors, values_json, meta, total, skipped, private=copy)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(path: Path) -> BinaryIO:
    """A new file for writing, unbuffered: big tensors go to the kernel straight from memory."""
    return open(path, "xb", buffering=0)  # noqa: SIM115 - the caller closes it


def _write_file(path: Path, data: bytes) -> int:
    """Write and fsync a new file; its size."""
    with _create(path) as f:
        view = memoryview(data)
        while view:
            view = view[f.write(view) :]
        os.fsync(f.fileno())
    return len(data)


def _file_entry(size: int, digests: list[str]) -> dict[str, Any]:
    """A data file's line in the manifest."""
    return {"size": size, "chunk_bytes": CHUNK_BYTES, _CHECKSUMS[FORMAT_VERSION][0]: digests}


def _chunk_digests(data: bytes | memoryview, algo: str, chunk: int | None) -> list[str]:
    """The checksum of each ``chunk`` bytes of ``data`` (of all of it when chunk is None)."""
    view = memoryview(data)
    step = chunk or max(len(view), 1)
    new = CHECKSUMS[algo]
    digests = []
    for i in range(0, max(len(view), 1), step):
        h = new()
        h.update(view[i : i + step])
        digests.append(h.hexdigest())
    return digests


def _write_values(path: Path, data: bytes) -> dict[str, Any]:
    algo = _CHECKSUMS[FORMAT_VERSION][1]
    return _file_entry(_write_file(path, data), _chunk_digests(data, algo, CHUNK_BYTES))


def _write_tensors(path: Path, prepared: Prepared) -> dict[str, Any]:
    hasher = ChunkHasher(CHUNK_BYTES, algo=_CHECKSUMS[FORMAT_VERSION][1])
    with _create(path) as f:
        size = write_safetensors(f, prepared.tensors, {"producer": "jobrun"}, hasher=hasher)
        os.fsync(f.fileno())
    return _file_entry(size, hasher.finish())


def _make_dirs(path: Path) -> None:
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
        _fsync_dir(d.parent)


def _write_error(e: OSError, target: Path, where: Path) -> CheckpointError:
    """A CheckpointError telling what failed, where, and how to fix it."""
    code = errno.errorcode.get(e.errno or 0, "")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device"
        hint = f"free disk space where {where} is, or set checkpoint.dir to a larger disk"
    elif e.errno in (errno.EACCES, errno.EPERM):
        what, hint = "permission denied", f"make {where} writable, or set checkpoint.dir"
    elif e.errno == errno.EROFS:
        what, hint = "read-only file system", "set checkpoint.dir to a writable directory"
    else:
        what = f"{e.strerror or e}" + (f" ({code})" if code else "")
        hint = f"check the disk holding {where}, or set checkpoint.dir"
    at = f" ({e.filename})" if e.filename and str(e.filename) != str(target) else ""
    return CheckpointError(f"{what} while writing {target}{at}", hint=hint)


def _discard(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _move_aside(dst: Path, aside: Path) -> bool:
    """Rename an existing dst to ``aside`` (to replace it); whether there was one."""
    if not dst.exists():
        return False
    os.replace(dst, aside)
    return True


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
    edir = epoch_dir(ckpt_dir, node, epoch)
    final = edir / f"rank-{rank}"
    tag = f"{rank}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp = edir / f".tmp-rank-{tag}"
    aside = edir / f".old-rank-{tag}"
    made_tmp = placed = had_old = False
    try:
        _make_dirs(edir)
        os.mkdir(tmp)
        made_tmp = True
        files = {
            TENSORS_FILE: _write_tensors(tmp / TENSORS_FILE, prepared),
            VALUES_FILE: _write_values(tmp / VALUES_FILE, prepared.values_json),
        }
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "node": node,
            "epoch": epoch,
            "rank": rank,
            "world_size": world_size,
            "created": time.time(),
            "seconds": round(time.perf_counter() - start, 6),
            "tensor_bytes": prepared.tensor_bytes,
            "skipped": list(prepared.skipped),
            "meta": prepared.meta,
            "files": files,
        }
        manifest_bytes = json.dumps(manifest, indent=1, allow_nan=False).encode()
        manifest_size = _write_file(tmp / MANIFEST_FILE, manifest_bytes)
        _fsync_dir(tmp)
        had_old = _move_aside(final, aside)
        os.replace(tmp, final)
        placed = True
        _fsync_dir(edir)
        manifest_sha = hashlib.sha256(manifest_bytes).hexdigest()
        commit_size = _write_commit(final, manifest_sha, node, epoch, rank, world_size)
    except BaseException as e:
        _undo(
            tmp if made_tmp and not placed else None,
            final if placed else None,
            final,
            aside,
            had_old,
        )
        if isinstance(e, OSError):
            raise _write_error(e, final, Path(ckpt_dir)) from e
        raise
    _discard(aside if had_old else None)
    size = sum(f["size"] for f in files.values()) + manifest_size + commit_size
    return SaveResult(final, size, time.perf_counter() - start)


def _write_commit(final: Path, manifest_sha: str, node: str, epoch: int, rank: int, ws: int) -> int:
    commit = {
        "manifest_sha256": manifest_sha,
        "node": node,
        "epoch": epoch,
        "rank": rank,
        "world_size": ws,
    }
    tmp = final / f".{COMMIT_FILE}.tmp-{secrets.token_hex(4)}"
    try:
        size = _write_file(tmp, json.dumps(commit).encode())
        os.replace(tmp, final / COMMIT_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final)
    return size


def _undo(tmp: Path | None, placed: Path | None, final: Path, aside: Path, had_old: bool) -> None:
    """After a failed save: drop what was written, and put back what it replaced."""
    _discard(tmp)
    _discard(placed)
    if had_old:
        # On failure the old copy stays aside (hidden) rather than half-restored.
        with contextlib.suppress(OSError):
            os.replace(aside, final)


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


# ---------------------------------------------------------------------------- checking


def _problem(what: str, hint: str = _HINT_RESUME) -> NoReturn:
    raise CheckpointError(what, hint=hint)


def _read_json(path: Path, what: str) -> tuple[bytes, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        _problem(f"{path} is missing")
    except OSError as e:
        _problem(f"cannot read {path}: {e.strerror or e}")
    try:
        return raw, json.loads(raw)
    except (ValueError, RecursionError):
        _problem(f"{path} is not valid JSON ({what} corrupt)")


def _expect(manifest: dict[str, Any], key: str, expected: Any, path: Path) -> None:
    if expected is not None and manifest.get(key) != expected:
        _problem(f"{path} is for {key} {manifest.get(key)!r}, not {expected!r} (moved or copied?)")


def _check_manifest(m: Any, path: Path) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        _problem(f"{path} is not a jobrun checkpoint manifest")
    if type(m.get("version")) is not int or not 1 <= m["version"] <= FORMAT_VERSION:
        _problem(
            f"{path} has format version {m.get('version')!r}; this jobrun reads versions "
            f"1 to {FORMAT_VERSION}",
            hint="upgrade jobrun to read this checkpoint",
        )
    ws, rank = m.get("world_size"), m.get("rank")
    if not (type(ws) is int and type(rank) is int and 0 <= rank < ws):
        _problem(f"{path}: bad rank {rank!r} / world_size {ws!r}")
    files = m.get("files")
    if not isinstance(files, dict) or set(files) != set(DATA_FILES):
        _problem(f"{path}: the file list must be exactly {', '.join(DATA_FILES)}")
    for name, info in files.items():
        if not _entry_ok(info, m["version"]):
            _problem(f"{path}: bad entry for {name}")
    if not isinstance(m.get("meta"), dict):
        _problem(f"{path}: meta is not an object")
    return m


def _entry_ok(info: Any, version: int) -> bool:
    """Whether a file's manifest entry is well formed: its size, and the checksums of
    its format version (one per chunk, or one for the whole file)."""
    if not (isinstance(info, dict) and type(info.get("size")) is int and info["size"] >= 0):
        return False
    key, _, pattern, chunked = _CHECKSUMS[version]
    if not chunked:
        return bool(pattern.fullmatch(str(info.get(key))))
    chunk, digests = info.get("chunk_bytes"), info.get(key)
    if type(chunk) is not int or chunk < 1 or not isinstance(digests, list):
        return False
    count = max(1, -(-info["size"] // chunk))
    return len(digests) == count and all(pattern.fullmatch(str(d)) for d in digests)


def _digests_of(info: dict[str, Any]) -> tuple[str, int | None, list[str]]:
    """(algorithm, chunk size, expected digests) of a checked entry; chunk None: one
    digest for the whole file."""
    for key, algo, _, chunked in _CHECKSUMS.values():
        if key in info:
            return (algo, info["chunk_bytes"], info[key]) if chunked else (algo, None, [info[key]])
    raise AssertionError("an entry checked by _entry_ok has checksums")


def _check_commit(
    rdir: Path, node: str | None = None, epoch: int | None = None, rank: int | None = None
) -> dict[str, Any]:
    """The manifest of a rank directory once COMMIT vouches for it; raises otherwise."""
    if not (rdir / COMMIT_FILE).exists():
        if not rdir.is_dir():
            _problem(f"{rdir} is missing")
        _problem(f"{rdir}: incomplete save: no {COMMIT_FILE} marker (the save was interrupted)")
    _, commit = _read_json(rdir / COMMIT_FILE, "commit marker")
    raw, manifest = _read_json(rdir / MANIFEST_FILE, "manifest")
    if (
        not isinstance(commit, dict)
        or commit.get("manifest_sha256") != hashlib.sha256(raw).hexdigest()
    ):
        _problem(f"{rdir}: {COMMIT_FILE} does not match {MANIFEST_FILE} (changed or corrupt)")
    m = _check_manifest(manifest, rdir / MANIFEST_FILE)
    for key in ("node", "epoch", "rank", "world_size"):
        if commit.get(key) != m.get(key):
            _problem(f"{rdir}: {COMMIT_FILE} and {MANIFEST_FILE} disagree on the {key}")
    _expect(m, "node", node, rdir)
    _expect(m, "epoch", epoch, rdir)
    _expect(m, "rank", rank, rdir)
    return m


def _size_problem(path: Path, size: int) -> str | None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if actual < size:
        return f"{path} is truncated: {actual} bytes, {size} expected"
    if actual > size:
        return f"{path} has {actual} bytes, {size} expected (changed after the save)"
    return None


def _checksum_problem(
    path: Path, algo: str, chunk: int | None, expected: list[str], got: list[str]
) -> str:
    """The message for the first chunk whose hash differs."""
    pairs = enumerate(zip(expected, got))
    k = next((i for i, (e, g) in pairs if e != g), min(len(expected), len(got)))
    want = expected[k] if k < len(expected) else "nothing"
    have = got[k] if k < len(got) else "nothing"
    where = ""
    if chunk is not None and len(expected) > 1:
        where = f" in bytes {k * chunk}-{(k + 1) * chunk}"
    return (
        f"{path}: checksum mismatch{where} ({algo} {have[:12]}, {want[:12]} expected): "
        "the file is corrupt"
    )


def _digest_problem(path: Path, info: dict[str, Any], got: list[str]) -> str | None:
    """A checksum mismatch of ``path`` against its manifest entry, or None."""
    algo, chunk, expected = _digests_of(info)
    return None if got == expected else _checksum_problem(path, algo, chunk, expected, got)


def _hash_file(path: Path, info: dict[str, Any]) -> list[str]:
    """The checksum of each chunk of the first ``size`` bytes of a file (as its manifest
    entry chunks it); several chunks are checked at once, each thread reading its own."""
    algo, chunk, _ = _digests_of(info)
    size = info["size"]
    step = chunk or max(size, 1)
    spans = [(at, min(size, at + step)) for at in range(0, max(size, 1), step)]
    if len(spans) == 1:
        return [_hash_span(path, algo, *spans[0], memoryview(bytearray(min(_READ, size) or 1)))]
    local = threading.local()  # one read buffer per thread

    def hash_span(span: tuple[int, int]) -> str:
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(_READ))
        return _hash_span(path, algo, *span, local.buf)

    with ThreadPoolExecutor(min(len(spans), io_lanes()), "jobrun-hash") as pool:
        return list(pool.map(hash_span, spans))


def _hash_span(path: Path, algo: str, begin: int, end: int, buf: memoryview) -> str:
    """The checksum of bytes [begin, end) of a file (of fewer when it is shorter)."""
    h = CHECKSUMS[algo]()
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        pos = begin
        while pos < end and (n := f.readinto(buf[: min(len(buf), end - pos)])):
            h.update(buf[:n])
            pos += n
    return h.hexdigest()


def _rank_problems(rdir: Path, ids: dict[str, Any], *, hashes: bool) -> list[str]:
    """What is wrong with one rank directory ([] when valid)."""
    try:
        m = _check_commit(rdir, **ids)
    except CheckpointError as e:
        return [e.message]
    problems: list[str] = []
    for name, info in m["files"].items():
        path = rdir / name
        problem = _size_problem(path, info["size"])
        if problem is None and hashes:
            try:
                problem = _digest_problem(path, info, _hash_file(path, info))
            except OSError as e:
                problem = f"cannot read {path}: {e.strerror or e}"
        if problem is None and hashes and name == TENSORS_FILE:
            try:
                read_header(path)
            except CheckpointError as e:
                problem = e.message
        if problem:
            problems.append(problem)
    return problems


def _manifest_loose(rdir: Path) -> dict[str, Any] | None:
    """The manifest as written, unchecked (None when unreadable): for listing only."""
    try:
        m = json.loads((rdir / MANIFEST_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return m if isinstance(m, dict) else None


def _world_size(ranks: dict[int, dict[str, Any] | None]) -> tuple[int | None, list[str]]:
    sizes = {m.get("world_size") for m in ranks.values() if m is not None}
    sizes = {s for s in sizes if type(s) is int and s > 0}
    if len(sizes) > 1:
        return max(sizes), [f"ranks disagree on the world size ({sorted(sizes)})"]
    return (sizes.pop() if sizes else None), []


def _node_problems(
    edir: Path, node: str, epoch: int, *, hashes: bool
) -> tuple[list[int], int | None, list[str]]:
    """(ranks found, world size, problems) of one node's epoch directory."""
    ranks = _ranks_in(edir)
    if not ranks:
        return [], None, [f"{edir}: no rank was saved"]
    loose = {r: _manifest_loose(edir / f"rank-{r}") for r in ranks}
    ws, problems = _world_size(loose)
    if ws is None:
        ws = max(ranks) + 1  # no readable manifest: judge by the ranks present
    missing = sorted(set(range(ws)) - set(ranks))
    if missing:
        problems.append(f"{edir}: rank {', '.join(map(str, missing))} of {ws} missing")
    extra = [r for r in ranks if r >= ws]
    if extra:
        problems.append(f"{edir}: rank {', '.join(map(str, extra))} beyond world size {ws}")
    for r in ranks:
        ids = {"node": node, "epoch": epoch, "rank": r}
        problems += _rank_problems(edir / f"rank-{r}", ids, hashes=hashes)
    return ranks, ws, problems


def verify(
    ckpt_dir: str | os.PathLike[str], node: str, epoch: int, rank: int | None = None
) -> list[str]:
    """Every problem of a saved epoch of one node ([] when valid), hashing every file.

    ``rank=None`` checks all ranks, expecting as many as the manifests' world size.
    """
    edir = epoch_dir(ckpt_dir, node, epoch)
    if not edir.is_dir():
        return [f"no checkpoint of node {node!r} at epoch {epoch} in {ckpt_dir}"]
    if rank is not None:
        ids = {"node": node, "epoch": epoch, "rank": _check_count("rank", rank)}
        rdir = edir / f"rank-{rank}"
        if not rdir.is_dir():
            return [_missing_rank(edir, rank)]
        return _rank_problems(rdir, ids, hashes=True)
    return _node_problems(edir, node, epoch, hashes=True)[2]


def verify_dir(rdir: str | os.PathLike[str]) -> list[str]:
    """Every problem of one rank directory (e.g. one copied by ``upload``)."""
    return _rank_problems(Path(rdir), {}, hashes=True)


def _missing_rank(edir: Path, rank: int) -> str:
    found = ", ".join(map(str, _ranks_in(edir))) or "none"
    return f"{edir}: rank {rank} is missing (ranks found: {found})"


# ---------------------------------------------------------------------------- loading


def _read_tensors(path: Path, info: dict[str, Any], as_numpy: bool, hashes: bool) -> dict[str, Any]:
    """The tensors file, hashed on the very bytes the tensors are built from."""
    if not hashes:
        return read_safetensors(path, as_numpy=as_numpy)
    algo, chunk, _ = _digests_of(info)
    hasher = ChunkHasher(chunk, algo=algo)
    try:
        tensors = read_safetensors(path, as_numpy=as_numpy, hasher=hasher)
    except CheckpointError as e:
        # A damaged file may fail to parse before its hash is known: say it is damaged.
        problem = _digest_problem(path, info, _hash_file(path, info))
        if problem:
            _problem(problem)
        raise e from None
    problem = _digest_problem(path, info, hasher.finish())
    if problem:
        _problem(problem)
    return tensors


def _read_values(path: Path, info: dict[str, Any], hashes: bool) -> dict[str, Any]:
    raw = path.read_bytes()
    algo, chunk, _ = _digests_of(info)
    got = _chunk_digests(raw, algo, chunk) if hashes else None
    if got is not None and (problem := _digest_problem(path, info, got)):
        _problem(problem)
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError):
        _problem(f"{path} is not valid JSON")
    if not isinstance(values, dict) or not isinstance(values.get("blobs"), dict):
        _problem(f"{path} holds no blobs")
    return values["blobs"]


def _load_rank(
    rdir: Path, ids: dict[str, Any], as_numpy: bool, hashes: bool = True
) -> tuple[dict[str, Any], dict]:
    m = _check_commit(rdir, **ids)
    files = m["files"]
    for name, info in files.items():
        problem = _size_problem(rdir / name, info["size"])
        if problem:
            _problem(problem)
    try:
        tensors = _read_tensors(rdir / TENSORS_FILE, files[TENSORS_FILE], as_numpy, hashes)
        tree = _read_values(rdir / VALUES_FILE, files[VALUES_FILE], hashes)
    except OSError as e:
        _problem(f"cannot read {rdir}: {e.strerror or e}")
    try:
        return decode(tree, tensors), m["meta"]
    except CheckpointError as e:
        raise CheckpointError(f"{rdir}: {e.message}", hint=e.hint) from None


def load(
    ckpt_dir: str | os.PathLike[str],
    node: str,
    epoch: int,
    rank: int = 0,
    *,
    as_numpy: bool = False,
    verify_hashes: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(workspace, meta) of a saved rank, after verifying it; CheckpointError otherwise.

    Tensors come back as CPU tensors (numpy arrays with ``as_numpy``, without importing
    torch); objects with a state as codec.SavedState. Every file is read once, and its
    hash is computed on the bytes the values are built from. ``verify_hashes=False``
    skips only the hashes (COMMIT, manifest and sizes are still checked), for a caller
    that has just run ``verify`` on this rank.
    """
    edir = epoch_dir(ckpt_dir, node, epoch)
    _check_count("rank", rank)
    if not edir.is_dir():
        _problem(
            f"no checkpoint of node {node!r} at epoch {epoch} in {ckpt_dir}",
            hint="see `jobrun ckpt list` for the saved epochs",
        )
    rdir = edir / f"rank-{rank}"
    if not rdir.is_dir():
        _problem(_missing_rank(edir, rank))
    ids = {"node": node, "epoch": epoch, "rank": rank}
    return _load_rank(rdir, ids, as_numpy, verify_hashes)


def read_manifest(
    ckpt_dir: str | os.PathLike[str], node: str, epoch: int, rank: int = 0
) -> dict[str, Any]:
    """The manifest of a saved rank, once its COMMIT vouches for it (data not hashed)."""
    rdir = rank_dir(ckpt_dir, node, epoch, rank)
    return _check_commit(rdir, node=node, epoch=epoch, rank=rank)


def load_dir(
    rdir: str | os.PathLike[str], *, as_numpy: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Like ``load``, for one rank directory given by path (e.g. one copied by ``upload``)."""
    return _load_rank(Path(rdir), {}, as_numpy)


# ---------------------------------------------------------------------------- listing


@dataclass
class NodeInfo:
    """One node's save of one epoch, as ``list_checkpoints`` sees it (no hashing)."""

    node: str
    epoch: int
    path: Path
    ranks: list[int]
    world_size: int | None
    bytes: int
    created: float | None  # unix time of the newest rank's save
    seconds: float | None  # the slowest rank's write time
    ok: bool
    problem: str | None


@dataclass
class EpochInfo:
    epoch: int
    nodes: dict[str, NodeInfo]

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes.values())


def _epoch_dirs(ckpt_dir: Path) -> Iterator[tuple[str, int, Path]]:
    try:
        names = os.listdir(ckpt_dir)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        _problem(f"cannot list {ckpt_dir}: {e.strerror or e}", hint="check the directory")
    for name in names:
        m = _EPOCH_DIR_RE.fullmatch(name)
        if m and ".." not in m["node"] and (ckpt_dir / name).is_dir():
            yield m["node"], int(m["epoch"]), ckpt_dir / name


def _node_info(node: str, epoch: int, edir: Path) -> NodeInfo:
    ranks, ws, problems = _node_problems(edir, node, epoch, hashes=False)
    total, created, seconds = 0, [], []
    for r in ranks:
        m = _manifest_loose(edir / f"rank-{r}") or {}
        for name in (*DATA_FILES, MANIFEST_FILE, COMMIT_FILE):
            with contextlib.suppress(OSError):
                total += (edir / f"rank-{r}" / name).stat().st_size
        if isinstance(m.get("created"), int | float):
            created.append(float(m["created"]))
        if isinstance(m.get("seconds"), int | float):
            seconds.append(float(m["seconds"]))
    return NodeInfo(
        node,
        epoch,
        edir,
        ranks,
        ws,
        total,
        max(created, default=None),
        max(seconds, default=None),
        not problems,
        "; ".join(problems) or None,
    )


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[EpochInfo]:
    """Every saved epoch, oldest first, with each node's ranks, size and validity.

    Cheap: reads manifests and COMMIT markers and checks file sizes, but hashes no data
    file (``verify`` does).
    """
    epochs: dict[int, EpochInfo] = {}
    for node, epoch, edir in _epoch_dirs(Path(ckpt_dir)):
        info = epochs.setdefault(epoch, EpochInfo(epoch, {}))
        info.nodes[node] = _node_info(node, epoch, edir)
    for info in epochs.values():
        info.nodes = dict(sorted(info.nodes.items()))
    return [epochs[e] for e in sorted(epochs)]


def _epoch_reason(
    ckpt_dir: Path, info: EpochInfo, nodes: list[str], world_size: int, hashes: bool
) -> str | None:
    """Why an epoch cannot be resumed from (None when it can)."""
    for node in nodes:
        n = info.nodes.get(node)
        if n is None:
            return f"node {node!r} has no checkpoint"
        if n.world_size is not None and n.world_size != world_size:
            return f"node {node!r} was saved with world size {n.world_size}, not {world_size}"
        if not n.ok:
            return f"node {node!r}: {n.problem}"
    if hashes:
        for node in nodes:
            problems = verify(ckpt_dir, node, info.epoch)
            if problems:
                return f"node {node!r}: {'; '.join(problems)}"
    return None


def latest_complete_epoch(
    ckpt_dir: str | os.PathLike[str],
    nodes: list[str],
    world_size: int,
    *,
    verify_hashes: bool = True,
    before: int | None = None,
) -> tuple[int | None, list[tuple[int, str]]]:
    """(the newest epoch where every node has every rank valid, [(newer epoch, why skipped)]).

    Epochs where none of ``nodes`` saved anything are ignored silently, and so are
    epochs ``before`` or later when it is given.
    """
    for node in nodes:
        _check_node(node)
    if not nodes:
        raise CheckpointError("latest_complete_epoch needs at least one node")
    skipped: list[tuple[int, str]] = []
    for info in reversed(list_checkpoints(ckpt_dir)):
        if not any(n in info.nodes for n in nodes) or (before is not None and info.epoch >= before):
            continue
        reason = _epoch_reason(Path(ckpt_dir), info, nodes, world_size, verify_hashes)
        if reason is None:
            return info.epoch, skipped
        skipped.append((info.epoch, reason))
    return None, skipped


def _remove_dir(path: Path) -> None:
    """Delete a directory: renamed away first, so a crash never leaves half of one visible."""
    doomed = path.with_name(f".deleting-{path.name}-{secrets.token_hex(4)}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(ckpt_dir: str | os.PathLike[str], keep: int, nodes: list[str]) -> list[int]:
    """Delete complete epochs older than the newest ``keep`` complete ones; their epochs.

    "Complete" means every node of ``nodes`` has every rank valid (cheap check). The
    newest complete epoch (normally the one just written) is always kept, and
    incomplete epochs are never deleted.
    """
    for node in nodes:
        _check_node(node)
    if type(keep) is not int or keep < 1:
        raise CheckpointError(f"bad number of checkpoints to keep: {keep!r}", hint="keep >= 1")
    complete = [
        info.epoch
        for info in list_checkpoints(ckpt_dir)
        if nodes and all(n in info.nodes and info.nodes[n].ok for n in nodes)
    ]
    doomed = complete[:-keep]
    for epoch in doomed:
        for node in nodes:
            try:
                _remove_dir(epoch_dir(ckpt_dir, node, epoch))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise CheckpointError(
                    f"cannot delete old checkpoint {node}.{epoch}: {e.strerror or e}",
                    hint=f"check the permissions of {ckpt_dir}",
                ) from e
    return doomed


# ---------------------------------------------------------------------------- upload


def _copy_file(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb") as f:
        os.fsync(f.fileno())


def upload(
    ckpt_dir: str | os.PathLike[str], node: str, epoch: int, dest_dir: str | os.PathLike[str]
) -> Path:
    """Copy one node's verified save of ``epoch`` (all ranks) to ``<dest_dir>/<node>``.

    The copy is atomic: written beside, then renamed over any previous one. The result
    holds ``rank-<r>/`` directories that ``load_dir`` and ``verify_dir`` accept.
    """
    problems = verify(ckpt_dir, node, epoch)
    if problems:
        _problem(f"cannot upload {node}.{epoch}: {'; '.join(problems)}")
    src = epoch_dir(ckpt_dir, node, epoch)
    dest_root = Path(dest_dir)
    dest = dest_root / node
    tag = f"{node}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp, aside = dest_root / f".tmp-{tag}", dest_root / f".old-{tag}"
    made = placed = had_old = False
    try:
        _make_dirs(dest_root)
        os.mkdir(tmp)
        made = True
        for r in _ranks_in(src):
            os.mkdir(tmp / f"rank-{r}")
            for name in (*DATA_FILES, MANIFEST_FILE, COMMIT_FILE):
                _copy_file(src / f"rank-{r}" / name, tmp / f"rank-{r}" / name)
            _fsync_dir(tmp / f"rank-{r}")
        _fsync_dir(tmp)
        had_old = _move_aside(dest, aside)
        os.replace(tmp, dest)
        placed = True
        _fsync_dir(dest_root)
    except BaseException as e:
        _undo(tmp if made and not placed else None, dest if placed else None, dest, aside, had_old)
        if isinstance(e, OSError):
            raise _write_error(e, dest, dest_root) from e
        raise
    _discard(aside if had_old else None)
    return dest
