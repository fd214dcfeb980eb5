"""One rank's checkpoint directory: checked, verified and loaded.

A rank's save is valid only when COMMIT is present, names the manifest's SHA-256, and
every file has the size and the checksums the manifest lists. Format version 3 is the
only one read: versions 1 and 2 (SHA-256 checksums) were written by jobrun before it
wrote tensors through the safetensors library, and are refused with a message saying so.

Checking and verifying never import torch (only ``load`` without ``as_numpy`` does), so
``jobrun ckpt list/show`` stay fast.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any, NoReturn

from jobrun import hints, records_schema, safefs
from jobrun.errors import CheckpointError
from jobrun.store import tensorfile
from jobrun.store.codec import decode
from jobrun.store.files import (
    COMMIT_FILE,
    DATA_FILES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    TENSORS_FILE,
    VALUES_FILE,
    check_count,
    epoch_dir,
    missing_rank,
    rank_dir,
)


def problem(what: str, hint: str | None = None) -> NoReturn:
    raise CheckpointError(what, hint=hint or f"resume from an earlier epoch (see `{hints.command('ckpt list')}`); "
                          "this one can be deleted")


# COMMIT and MANIFEST.json are small: a bigger one is damaged (and never read whole).
MAX_JSON_BYTES = 64 << 20


def _read_json(path: Path, what: str) -> tuple[bytes, Any]:
    try:
        raw = safefs.read_bounded(path, MAX_JSON_BYTES)
    except FileNotFoundError:
        problem(f"{path} is missing")
    except safefs.UnsafeFile as e:
        problem(f"{e.strerror} ({what} replaced)")
    except OSError as e:
        problem(f"cannot read {path}: {e.strerror or e}")
    if len(raw) > MAX_JSON_BYTES:
        problem(f"{path} is over {MAX_JSON_BYTES >> 20} MiB ({what} corrupt)")
    try:
        return raw, records_schema.parse_json(raw)
    except ValueError as e:
        problem(f"{path} is not valid JSON ({what} corrupt: {e})")


def _check_manifest(m: Any, path: Path) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        problem(f"{path} is not a jobrun checkpoint manifest")
    version = m.get("version")
    if type(version) is int and version in (1, 2):
        problem(
            f"{path} has checkpoint format {version}: this checkpoint was written by an older "
            f"jobrun, and this one reads format {FORMAT_VERSION} only",
            hint="resume from a newer checkpoint, or train again; this one can be deleted",
        )
    if type(version) is not int or version != FORMAT_VERSION:
        problem(
            f"{path} has checkpoint format {version!r}; this jobrun reads format {FORMAT_VERSION}",
            hint="upgrade jobrun to read this checkpoint",
        )
    try:  # every field's type and range (records_schema.MANIFEST), then how they fit together
        records_schema.check(m, records_schema.MANIFEST)
    except records_schema.Invalid as e:
        entry = next((n for n in DATA_FILES if e.where.startswith(f"files.{n}")), None)
        problem(f"{path}: bad entry for {entry} (field {e})" if entry else f"{path}: field {e}")
    if m["rank"] >= m["world_size"]:
        problem(f"{path}: bad rank {m['rank']!r} / world_size {m['world_size']!r}")
    if set(m["files"]) != set(DATA_FILES):
        problem(f"{path}: the file list must be exactly {', '.join(DATA_FILES)}")
    for name, info in m["files"].items():
        if len(info["crc32_chunks"]) != max(1, -(-info["size"] // info["chunk_bytes"])):
            problem(f"{path}: bad entry for {name}")
    return m


def manifest_of(rdir: Path) -> dict[str, Any] | None:
    """The manifest of a rank directory, checked but not vouched for by COMMIT (a save
    may be incomplete): for listing. None when it is missing or damaged."""
    try:
        _, m = _read_json(rdir / MANIFEST_FILE, "manifest")
        return _check_manifest(m, rdir / MANIFEST_FILE)
    except CheckpointError:
        return None


def check_commit(
    rdir: Path, node: str | None = None, epoch: int | None = None, rank: int | None = None
) -> dict[str, Any]:
    """The manifest of a rank directory once COMMIT vouches for it; raises otherwise."""
    try:
        os.stat(rdir / COMMIT_FILE)
    except (FileNotFoundError, NotADirectoryError):
        if not rdir.is_dir():
            problem(f"{rdir} is missing")
        problem(f"{rdir}: incomplete save: no {COMMIT_FILE} marker (the save was interrupted)")
    except OSError as e:  # a directory made unreadable (chmod)
        problem(f"cannot read {rdir}: {e.strerror or e}")
    _, commit = _read_json(rdir / COMMIT_FILE, "commit marker")
    raw, manifest = _read_json(rdir / MANIFEST_FILE, "manifest")
    try:
        commit = records_schema.check(commit, records_schema.COMMIT)
    except records_schema.Invalid as e:
        problem(f"{rdir / COMMIT_FILE}: field {e}")
    if commit["manifest_sha256"] != hashlib.sha256(raw).hexdigest():
        problem(f"{rdir}: {COMMIT_FILE} does not match {MANIFEST_FILE} (changed or corrupt)")
    m = _check_manifest(manifest, rdir / MANIFEST_FILE)
    for key in ("node", "epoch", "rank", "world_size"):
        if commit.get(key) != m.get(key):
            problem(f"{rdir}: {COMMIT_FILE} and {MANIFEST_FILE} disagree on the {key}")
    for key, expected in (("node", node), ("epoch", epoch), ("rank", rank)):
        if expected is not None and m.get(key) != expected:
            problem(f"{rdir} is for {key} {m.get(key)!r}, not {expected!r} (moved or copied?)")
    return m


def _size_problem(path: Path, size: int) -> str | None:
    """What is wrong with a data file's size, or that it is not a regular file (a FIFO
    would block its reader; a symlink leads out of the checkpoint)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    actual = st.st_size
    if actual < size:
        return f"{path} is truncated: {actual} bytes, {size} expected"
    if actual > size:
        return f"{path} has {actual} bytes, {size} expected (changed after the save)"
    return None


def _checksum_problem(path: Path, info: dict[str, Any], got: list[str]) -> str | None:
    """The message for the first chunk whose checksum differs, or None."""
    expected, chunk = info["crc32_chunks"], info["chunk_bytes"]
    if got == expected:
        return None
    pairs = enumerate(zip(expected, got))
    k = next((i for i, (e, g) in pairs if e != g), min(len(expected), len(got)))
    want = expected[k] if k < len(expected) else "nothing"
    have = got[k] if k < len(got) else "nothing"
    where = f" in bytes {k * chunk}-{(k + 1) * chunk}" if len(expected) > 1 else ""
    return f"{path}: checksum mismatch{where} (crc32 {have}, {want} expected): the file is corrupt"


def rank_problems(rdir: Path, ids: dict[str, Any], *, hashes: bool, decode: bool = False) -> list[str]:
    """What is wrong with one rank directory ([] when valid); ``hashes``: read every byte;
    ``decode``: also decode every value (without torch), as a load would."""
    try:
        m = check_commit(rdir, **ids)
    except CheckpointError as e:
        return [e.message]
    problems: list[str] = []
    for name, info in m["files"].items():
        path = rdir / name
        found = _size_problem(path, info["size"])
        if found is None and hashes:
            try:
                found = _checksum_problem(
                    path, info, tensorfile.checksum_file(path, info["chunk_bytes"])
                )
            except OSError as e:
                found = f"cannot read {path}: {e.strerror or e}"
        if found:
            problems.append(found)
    if decode and not problems:
        # Intact bytes that do not decode (a damaged file re-sealed) are no checkpoint either.
        try:
            _load_rank(rdir, ids, as_numpy=True, hashes=False)
        except CheckpointError as e:
            problems.append(e.message)
    return problems


def verify_dir(rdir: str | os.PathLike[str]) -> list[str]:
    """Every problem of one rank directory (e.g. one copied by ``upload``), reading every byte."""
    return rank_problems(Path(rdir), {}, hashes=True, decode=True)


def read_manifest(
    ckpt_dir: str | os.PathLike[str], node: str, epoch: int, rank: int = 0
) -> dict[str, Any]:
    """The manifest of a saved rank, once its COMMIT vouches for it (data not checked)."""
    rdir = rank_dir(ckpt_dir, node, epoch, rank)
    return check_commit(rdir, node=node, epoch=epoch, rank=rank)


# ---------------------------------------------------------------------------- loading


def load(
    ckpt_dir: str | os.PathLike[str],
    node: str,
    epoch: int,
    rank: int = 0,
    *,
    as_numpy: bool = False,
    verify_hashes: bool = True,
    blobs: Collection[str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(workspace, meta) of a saved rank, after verifying it; CheckpointError otherwise.

    ``blobs``: only these (those missing are left out), their tensors read one by one,
    without checksums (for a caller that verifies the rank or trusts it already).

    Tensors come back as CPU tensors (numpy arrays with ``as_numpy``, without importing
    torch); objects with a state as codec.SavedState. The checksums are computed on the
    very bytes the values are built from. ``verify_hashes=False`` skips only the
    checksums (COMMIT, manifest and sizes are still checked), for a caller that has just
    run ``verify`` on this rank.
    """
    edir = epoch_dir(ckpt_dir, node, epoch)
    check_count("rank", rank)
    if not edir.is_dir():
        problem(
            f"no checkpoint of node {node!r} at epoch {epoch} in {ckpt_dir}",
            hint=f"see `{hints.command('ckpt list')}` for the saved epochs",
        )
    rdir = edir / f"rank-{rank}"
    if not rdir.is_dir():
        problem(missing_rank(edir, rank))
    return _load_rank(rdir, {"node": node, "epoch": epoch, "rank": rank}, as_numpy, verify_hashes,
                      blobs)


def load_dir(
    rdir: str | os.PathLike[str], *, as_numpy: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Like ``load``, for one rank directory given by path (e.g. one copied by ``upload``)."""
    return _load_rank(Path(rdir), {}, as_numpy, hashes=True)


def _load_rank(
    rdir: Path, ids: dict[str, Any], as_numpy: bool, hashes: bool,
    blobs: Collection[str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    m = check_commit(rdir, **ids)
    files = m["files"]
    for name, info in files.items():
        if found := _size_problem(rdir / name, info["size"]):
            problem(found)
    from safetensors import SafetensorError

    try:
        tree = _read_values(rdir / VALUES_FILE, files[VALUES_FILE], hashes and blobs is None)
        if blobs is None:
            tensors = _read_tensors(rdir / TENSORS_FILE, files[TENSORS_FILE], as_numpy, hashes)
        else:
            tree = {name: tree[name] for name in blobs if name in tree}
            tensors = tensorfile.Lazy(rdir / TENSORS_FILE, as_numpy=as_numpy)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):  # another account's files: not damage
            problem(f"cannot read {rdir}: {e.strerror or e}",
                    hint="check the files' permissions (a run of another account?); the checkpoint "
                         "may be intact")
        problem(f"cannot read {rdir}: {e.strerror or e}")
    except SafetensorError as e:
        problem(f"{rdir / TENSORS_FILE} cannot be read: {e}")
    try:
        return decode(tree, tensors), m["meta"]
    except CheckpointError as e:
        raise CheckpointError(f"{rdir}: {e.message}", hint=e.hint) from None


def _read_tensors(path: Path, info: dict[str, Any], as_numpy: bool, hashes: bool) -> dict:
    from safetensors import SafetensorError

    sums = tensorfile.Checksums(info["chunk_bytes"]) if hashes else None
    try:
        tensors = tensorfile.read(path, as_numpy=as_numpy, sums=sums)
    except (SafetensorError, ValueError) as e:
        # A damaged file may fail to parse before its checksums are known: say it is damaged.
        got = tensorfile.checksum_file(path, info["chunk_bytes"])
        problem(_checksum_problem(path, info, got) or f"{path} cannot be read: {e}")
    if sums is not None and (found := _checksum_problem(path, info, sums.digests())):
        problem(found)
    return tensors


def _read_values(path: Path, info: dict[str, Any], hashes: bool) -> dict[str, Any]:
    raw = safefs.read_bounded(path, info["size"])  # regular files only, no more than the manifest says
    if hashes:
        got = tensorfile.checksum_bytes(raw, info["chunk_bytes"])
        if found := _checksum_problem(path, info, got):
            problem(found)
    try:
        values = records_schema.parse_json(raw)
    except ValueError as e:
        problem(f"{path} is not valid JSON ({e})")
    if not isinstance(values, dict) or not isinstance(values.get("blobs"), dict):
        problem(f"{path} holds no blobs")
    return values["blobs"]
