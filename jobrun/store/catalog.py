"""The saved epochs of a checkpoint directory: list, verify, the latest complete one, prune, upload.

An epoch is complete when every node of the job saved every rank of it validly.
Listing is cheap (COMMIT markers, manifests and file sizes); ``verify`` reads every byte.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobrun import safefs
from jobrun.errors import CheckpointError
from jobrun.safedel import remove_in
from jobrun.store.files import (
    COMMIT_FILE,
    DATA_FILES,
    EPOCH_SHAPE,
    MANIFEST_FILE,
    RANK_SHAPE,
    check_count,
    check_node,
    checkpoint_dir_shape,
    damaged_save,
    epoch_dir,
    make_dirs,
    missing_rank,
    place_dir,
    ranks_in,
    write_error,
)
from jobrun.store.read import manifest_of, problem, rank_problems

_EPOCH_DIR_RE = re.compile(r"(?P<node>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})\.(?P<epoch>0|[1-9][0-9]*)")


@dataclass
class NodeInfo:
    """One node's save of one epoch, as ``list_checkpoints`` sees it (no checksums)."""

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
    meta: dict[str, Any] | None = None  # the lowest rank's manifest meta (the runner's)
    missing: list[int] = field(default_factory=list)  # ranks of its world size not here
    intact_here: bool = False  # the ranks here pass the cheap checks and agree on the world size



@dataclass
class EpochInfo:
    epoch: int
    nodes: dict[str, NodeInfo]

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes.values())


def _node_problems(
    edir: Path, node: str, epoch: int, *, hashes: bool, decode: bool = False
) -> tuple[list[int], int | None, list[str], list[int]]:
    """(ranks found, world size, problems, ranks missing) of one node's epoch directory;
    the problems name the missing ranks too."""
    ranks = ranks_in(edir)
    if not ranks:
        try:
            os.listdir(edir)
        except OSError as e:  # a directory made unreadable (chmod)
            return [], None, [f"cannot read {edir}: {e.strerror or e}"], []
        return [], None, [f"{edir}: no rank was saved"], []
    loose = [m for r in ranks if (m := manifest_of(edir / f"rank-{r}")) is not None]
    sizes = {s for m in loose if type(s := m.get("world_size")) is int and s > 0}
    problems = [f"ranks disagree on the world size ({sorted(sizes)})"] if len(sizes) > 1 else []
    # No readable manifest: judge by the ranks present.
    ws = max(sizes) if sizes else max(ranks) + 1
    missing = sorted(set(range(ws)) - set(ranks))
    if missing:
        problems.append(f"{edir}: rank {', '.join(map(str, missing))} of {ws} missing")
    extra = [r for r in ranks if r >= ws]
    if extra:
        problems.append(f"{edir}: rank {', '.join(map(str, extra))} beyond world size {ws}")
    for r in ranks:
        ids = {"node": node, "epoch": epoch, "rank": r}
        problems += rank_problems(edir / f"rank-{r}", ids, hashes=hashes, decode=decode)
    return ranks, (max(sizes) if sizes else None), problems, missing


def verify(
    ckpt_dir: str | os.PathLike[str], node: str, epoch: int, rank: int | None = None,
    *, hashes: bool = True, decode: bool = True,
) -> list[str]:
    """Every problem of a saved epoch of one node ([] when valid), reading every byte
    (``hashes=False``: the cheap checks only, COMMIT, manifests and sizes).

    ``rank=None`` checks all ranks, expecting as many as the manifests' world size.
    ``decode``: also decode every value, as a load would (reads the data a second time).
    """
    edir = epoch_dir(ckpt_dir, node, epoch)
    if not edir.is_dir():
        return [f"no checkpoint of node {node!r} at epoch {epoch} in {ckpt_dir}"]
    if rank is None:
        return _node_problems(edir, node, epoch, hashes=hashes, decode=decode)[2]
    rdir = edir / f"rank-{check_count('rank', rank)}"
    if not rdir.is_dir():
        return [missing_rank(edir, rank)]
    return rank_problems(rdir, {"node": node, "epoch": epoch, "rank": rank}, hashes=hashes, decode=decode)


def saved_world_size(ckpt_dir: str | os.PathLike[str], nodes: list[str], epoch: int) -> int | None:
    """How many ranks saved ``epoch``, as the manifests found here say (None: no readable
    one). On a host without a shared disk, only its own ranks' manifests are here."""
    sizes = set()
    for node in nodes:
        edir = epoch_dir(ckpt_dir, node, epoch)
        for r in ranks_in(edir) if edir.is_dir() else ():
            m = manifest_of(edir / f"rank-{r}")
            if m is not None and type(m.get("world_size")) is int and m["world_size"] > 0:
                sizes.add(m["world_size"])
    return max(sizes) if sizes else None


def _epoch_dirs(ckpt_dir: Path) -> Iterator[tuple[str, int, Path]]:
    try:
        names = os.listdir(ckpt_dir)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        problem(f"cannot list {ckpt_dir}: {e.strerror or e}", hint="check the directory")
    for name in names:
        m = _EPOCH_DIR_RE.fullmatch(name)
        if m and ".." not in m["node"] and (ckpt_dir / name).is_dir():
            yield m["node"], int(m["epoch"]), ckpt_dir / name


def _node_info(node: str, epoch: int, edir: Path) -> NodeInfo:
    ranks, ws, problems, missing = _node_problems(edir, node, epoch, hashes=False)
    total, created, seconds = 0, [], []
    meta = None
    for r in ranks:
        m = manifest_of(edir / f"rank-{r}") or {}
        if meta is None:
            meta = m.get("meta")
        for name in (*DATA_FILES, MANIFEST_FILE, COMMIT_FILE):
            with contextlib.suppress(OSError):
                total += (edir / f"rank-{r}" / name).stat().st_size
        if "created" in m:
            created.append(float(m["created"]))
        if "seconds" in m:
            seconds.append(float(m["seconds"]))
    return NodeInfo(
        node, epoch, edir, ranks, ws, total, max(created, default=None),
        max(seconds, default=None), not problems, "; ".join(problems) or None, meta, missing,
        # On a host of a job without a shared disk, its share of a complete epoch.
        intact_here=ws is not None and len(problems) == bool(missing),
    )


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[EpochInfo]:
    """Every saved epoch, oldest first, with each node's ranks, size and validity.

    Cheap: reads manifests and COMMIT markers and checks file sizes, but reads no data
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
    ckpt_dir: Path, info: EpochInfo, nodes: list[str], world_size: int | None, hashes: bool
) -> str | None:
    """Why an epoch cannot be resumed from (None when it can)."""
    for node in nodes:
        n = info.nodes.get(node)
        if n is None:
            return f"node {node!r} has no checkpoint"
        if world_size is not None and n.world_size is not None and n.world_size != world_size:
            return (f"node {node!r} was saved with world size {n.world_size}, not {world_size}: "
                    f"resume with {n.world_size} replicas (--replicas {n.world_size})")
        if not n.ok:
            return f"node {node!r}: {n.problem}"
    if hashes:
        for node in nodes:
            problems = verify(ckpt_dir, node, info.epoch)
            if problems:
                return f"node {node!r}: {'; '.join(problems)}"
    return None


def complete_epochs(ckpt_dir: str | os.PathLike[str], nodes: list[str]) -> list[int]:
    """The epochs, oldest first, where every one of ``nodes`` has all the files and
    markers of every rank its manifests name, as `latest_complete_epoch` judges them
    without reading checksums. Epochs where none of ``nodes`` saved anything are left out."""
    return [info.epoch for info in list_checkpoints(ckpt_dir)
            if any(n in info.nodes for n in nodes)
            and _epoch_reason(Path(ckpt_dir), info, nodes, None, False) is None]


def latest_complete_epoch(
    ckpt_dir: str | os.PathLike[str],
    nodes: list[str],
    world_size: int | None,
    *,
    verify_hashes: bool = True,
    before: int | None = None,
) -> tuple[int | None, list[tuple[int, str]]]:
    """(the newest epoch where every node has every rank valid, [(newer epoch, why skipped)]).

    ``world_size``: the number of ranks an epoch must have been saved by (None: any, each
    epoch complete with the ranks its manifests name). Epochs where none of ``nodes``
    saved anything are ignored silently, and so are epochs ``before`` or later when it
    is given.
    """
    for node in nodes:
        check_node(node)
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


def prune(
    ckpt_dir: str | os.PathLike[str], keep: int, nodes: list[str], protect: Collection[int] = ()
) -> list[int]:
    """Delete complete epochs older than the newest ``keep`` complete ones; their epochs.

    "Complete" means every node of ``nodes`` has every rank valid (cheap check). The
    newest complete epoch (normally the one just written) is always kept, and so are
    incomplete epochs and the epochs in ``protect`` (the caller's choice, e.g. the best
    ones by a metric: the store knows nothing of plans).
    """
    doomed = prunable(ckpt_dir, keep, nodes, protect)
    delete_epochs(ckpt_dir, nodes, doomed)
    return doomed


def prunable(
    ckpt_dir: str | os.PathLike[str], keep: int, nodes: list[str], protect: Collection[int] = (),
    complete: Collection[int] = (),
) -> list[int]:
    """The epochs :func:`prune` deletes, oldest first, without deleting them.

    ``complete``: epochs the caller knows every rank saved, complete whatever this
    directory holds. A data-parallel job on hosts without a shared disk keeps each host's
    ranks' files on that host, so no epoch looks complete to any one of them; its ranks
    say together which epochs they saved (:func:`saved_by`).
    """
    for node in nodes:
        check_node(node)
    if type(keep) is not int or keep < 1:
        raise CheckpointError(f"bad number of checkpoints to keep: {keep!r}", hint="keep >= 1")
    every = sorted(set(complete_epochs(ckpt_dir, nodes)).union(complete))
    return [e for e in every[:-keep] if e not in protect]


def saved_by(ckpt_dir: str | os.PathLike[str], nodes: list[str], rank: int, world_size: int) -> list[int]:
    """The epochs, oldest first, for which rank ``rank`` of a ``world_size``-rank job saved
    every one of ``nodes`` here, and the ranks here are intact (``NodeInfo.intact_here``:
    all files and markers there; no checksums read)."""
    return [info.epoch for info in list_checkpoints(ckpt_dir)
            if nodes and all(n in info.nodes and rank in info.nodes[n].ranks
                             and info.nodes[n].world_size == world_size and info.nodes[n].intact_here
                             for n in nodes)]


def intact_epochs(nodes: list[str], infos: list[EpochInfo]) -> list[int]:
    """The epochs of ``infos`` (list_checkpoints), oldest first, where the ranks of every
    one of ``nodes`` that are here are intact (``NodeInfo.intact_here``)."""
    return [i.epoch for i in infos if nodes and all(n in i.nodes and i.nodes[n].intact_here for n in nodes)]


def in_the_way(ckpt_dir: str | os.PathLike[str], nodes: list[str], epochs: Collection[int]) -> list[int]:
    """Of ``epochs``, those holding a damaged save (files.damaged_save) of one of ``nodes``,
    which a save of the epoch could not write over."""
    return [e for e in epochs if any(damaged_save(epoch_dir(ckpt_dir, n, e) / f"rank-{r}")
                                     for n in nodes for r in ranks_in(epoch_dir(ckpt_dir, n, e)))]


def delete_epochs(ckpt_dir: str | os.PathLike[str], nodes: list[str], epochs: Collection[int]) -> list[str]:
    """Delete ``nodes``' saves of ``epochs`` here (those this directory holds), each renamed
    away first, so that a crash never leaves half of one visible. Only what a save writes
    is deleted (jobrun.safedel): a file someone added to an epoch stays, in the renamed
    directory, and so does a rank whose manifest does not say it is jobrun's (damaged).
    Returns what stayed, relative to ``ckpt_dir``."""
    shape, kept = checkpoint_dir_shape(nodes), []
    for epoch in epochs:
        for node in nodes:
            path = epoch_dir(ckpt_dir, node, epoch)
            try:
                gone = path.with_name(f".deleting-{path.name}-{secrets.token_hex(4)}")
                os.replace(path, gone)
            except FileNotFoundError:
                continue  # not on this host, or another host sharing the disk was first
            except OSError as e:
                raise CheckpointError(
                    f"cannot delete old checkpoint {node}.{epoch}: {e.strerror or e}",
                    hint=f"check the permissions of {ckpt_dir}",
                ) from e
            with contextlib.suppress(OSError):
                kept += remove_in(Path(ckpt_dir), shape, [gone.name])
    # Not inside epochs: the other ranks may be writing this very epoch while rank 0
    # prunes, and their files in progress are no leftovers.
    clean(ckpt_dir, inside_epochs=False)
    return kept


# What a save or a prune leaves behind when it is killed (see files.place_dir and prune):
# a temporary directory or marker named with the writer's pid, an old copy moved aside,
# an epoch renamed away for deletion.
# A COMMIT marker being written carries its writer's pid too (before 2026-11-26 it did
# not: such a leftover is only ever an old version's, and is removed).
_LEFTOVER = re.compile(r"\.(?:tmp|old)-(?P<name>.+)-(?P<pid>\d+)-[0-9a-f]{8}|\.deleting-.+"
                       r"|\.COMMIT\.tmp-(?:(?P<commit_pid>\d+)-)?[0-9a-f]{8}")


def clean(ckpt_dir: str | os.PathLike[str], inside_epochs: bool = True) -> list[str]:
    """Remove the leftovers of killed saves and prunes (never those of a process that is
    still running); a rank whose rename was cut short gets its old copy back. Returns
    what it removed, relative to ``ckpt_dir``. ``inside_epochs=False``: only in
    ``ckpt_dir`` itself, where prunes leave theirs (the whole clean runs where no rank
    writes: at resume, at a restart before the ranks meet)."""
    root = Path(ckpt_dir)
    places = [(root, checkpoint_dir_shape())]
    for _node, _epoch, edir in _epoch_dirs(root) if inside_epochs else ():
        places.append((edir, EPOCH_SHAPE))
        places += [(edir / f"rank-{r}", RANK_SHAPE) for r in ranks_in(edir)]
    removed: list[str] = []
    for d, shape in places:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for entry in entries:
            m = _LEFTOVER.fullmatch(entry.name)
            pid = m and (m["pid"] or m["commit_pid"])
            if m is None or (pid and int(pid) != os.getpid() and _alive(int(pid))):
                continue
            path = Path(entry.path)
            if entry.name.startswith(".old-") and not (d / m["name"]).exists():
                with contextlib.suppress(OSError):
                    os.replace(path, d / m["name"])  # the new copy never arrived: keep the old
                    continue
            # What a save leaves goes; anything else there (a link, a user's file) stays.
            try:
                kept = remove_in(d, shape, [entry.name])
            except OSError:
                continue
            if not kept:
                removed.append(str(path.relative_to(root)))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def upload(
    ckpt_dir: str | os.PathLike[str], node: str, epoch: int, dest_dir: str | os.PathLike[str]
) -> Path:
    """Copy one node's verified save of ``epoch`` (all ranks) to ``<dest_dir>/<node>``.

    Each rank's copy is atomic: written beside, then renamed over the previous upload's.
    An existing ``<dest_dir>/<node>`` is written into, never emptied: what else it holds
    stays, and a ``rank-<r>`` there that holds files a save does not write is refused.
    The result holds ``rank-<r>/`` directories that ``load_dir`` and ``verify_dir`` accept.
    """
    problems = verify(ckpt_dir, node, epoch)
    if problems:
        problem(f"cannot upload {node}.{epoch}: {'; '.join(problems)}")
    src = epoch_dir(ckpt_dir, node, epoch)
    dest = Path(dest_dir) / node
    ranks = ranks_in(src)
    try:
        make_dirs(dest)
        if dest.is_symlink() or not dest.is_dir():
            raise CheckpointError(f"cannot upload to {dest}: it is not a directory (a link or a file)",
                                  hint="remove it, or set checkpoint.upload to another directory")
        for r in ranks:
            _refuse_foreign(dest / f"rank-{r}")
        for r in ranks:
            place_dir(dest / f"rank-{r}", lambda tmp, r=r: _copy_rank(src / f"rank-{r}", tmp),
                      lambda _: None)
        # An earlier upload by more ranks: its extra ranks would make this one two in one.
        remove_in(dest, EPOCH_SHAPE, [f"rank-{r}" for r in ranks_in(dest) if r not in ranks])
    except OSError as e:
        raise write_error(e, dest, Path(dest_dir)) from e
    return dest


def _refuse_foreign(rdir: Path) -> None:
    """Refuse to replace a rank directory holding files a save does not write."""
    try:
        st = os.lstat(rdir)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    else:
        foreign = sorted(e.name for e in os.scandir(rdir)
                         if not (RANK_SHAPE.owns_file(e.name) and e.is_file(follow_symlinks=False)))
        if not foreign:
            return
        what = f"holds files jobrun did not write ({', '.join(foreign[:5])})"
    raise CheckpointError(f"cannot upload into {rdir}: it {what}",
                          hint="move it elsewhere, or set checkpoint.upload to another directory")


def _copy_rank(src: Path, tmp: Path) -> None:
    """Copy a rank's files into the new directory ``tmp``: read without following a link,
    written as new files."""
    for name in (*DATA_FILES, MANIFEST_FILE, COMMIT_FILE):
        with os.fdopen(safefs.open_read(src / name), "rb") as fin, \
                os.fdopen(safefs.create_new(tmp / name), "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
            fout.flush()
            os.fsync(fout.fileno())
