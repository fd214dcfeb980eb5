"""Which checkpoint epoch a resume or a restart starts from, checksummed.

    one process (`jobrun resume`): it checks every rank's files
    several processes (under torchrun, or the ranks of a restart): each checks only the
        files its own rank restores, and they agree through an all-gather, so that all
        pick, skip or refuse the same epoch; no process needs another host's files

An epoch is usable when every node's files of it are complete and intact. The cheap
checks (COMMIT, manifests, sizes) come first; the newest epoch that passes them is then
checksummed (each byte read once, by the process it belongs to), and skipped with a
warning when that fails.

A checkpoint written by N ranks restores into M ranks only when asked for (`resume
--replicas M`): rank r restores rank r's files, and a rank the checkpoint has no files
of (r >= N) restores rank 0's (see :func:`source_rank`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobrun import hints, store
from jobrun.errors import CheckpointError, UsageError
from jobrun.plans import ir
from jobrun.runner import rng

Gather = Callable[[Any], list[Any]]


def source_rank(rank: int, saved_world: int) -> int:
    """The rank whose files rank ``rank`` restores from a checkpoint of ``saved_world``
    ranks: its own, or rank 0's when the checkpoint has none (a resume with more
    replicas). In data parallel every rank holds the same model, optimizer and reader
    positions, so any rank's files give them."""
    return rank if rank < saved_world else 0


def pick_epoch(ckpt_dir: Path, plan: ir.Plan, replicas: int, epoch: int | None, *,
               change_ok: bool = False, rank: int | None = None,
               gather: Gather | None = None, said: list[str] | None = None) -> tuple[int, int]:
    """(epoch, the number of ranks that wrote it): ``epoch``, or else the newest usable
    one (each newer one skipped with a warning, also added to ``said``; with ``rank``,
    rank 0 says them).

    ``replicas``: the ranks of the run that resumes; a checkpoint written by another
    number is refused unless ``change_ok``. ``rank`` None: this process checks every
    rank. Otherwise it checks the files ``rank`` restores and ``gather`` (an all-gather
    over the processes) shares what each found.
    """
    nodes, said = list(plan.nodes), [] if said is None else said
    if rank is None:
        return _pick_alone(ckpt_dir, nodes, replicas, epoch, change_ok, said)
    return _pick_together(ckpt_dir, nodes, replicas, epoch, change_ok, rank, gather or (lambda x: [x]),
                          said)


def replicas_text(n: int) -> str:
    return f"{n} replica{'s' * (n != 1)}"


def _refuse_world(epoch: int, saved: int, replicas: int) -> CheckpointError:
    return CheckpointError(
        f"checkpoint epoch {epoch} was written by {replicas_text(saved)}; this run has {replicas}",
        hint=f"resume with {replicas_text(saved)} (--replicas {saved}), or give --replicas {replicas} "
             f"to go on with {replicas} (docs/multi-host.md says what a change of replicas preserves)")


class NoCheckpoint(CheckpointError):
    """No complete checkpoint at all (the run stopped before its first): resume names the
    `jobrun train` that starts it again, which it knows from run.json."""


def _no_checkpoint(ckpt_dir: Path) -> CheckpointError:
    return NoCheckpoint(f"no complete checkpoint in {ckpt_dir}", hint="train again with `jobrun train`")


def _pick_alone(ckpt_dir: Path, nodes: list[str], replicas: int, epoch: int | None,
                change_ok: bool, said: list[str]) -> tuple[int, int]:
    def saved(e: int) -> int:
        return store.saved_world_size(ckpt_dir, nodes, e) or replicas

    def problems(e: int) -> tuple[str, list[str]] | None:
        for node in nodes:
            # A random state that does not decode makes the epoch unusable too.
            found = store.verify(ckpt_dir, node, e, decode=False) or rng.saved_problems(
                ckpt_dir, node, e, list(range(store.read_manifest(ckpt_dir, node, e)["world_size"])))
            if found:
                return node, found
        return None

    if epoch is not None:
        if not any(store.epoch_dir(ckpt_dir, n, epoch).exists() for n in nodes):
            raise _missing(ckpt_dir, nodes, epoch)
        bad = problems(epoch)
        if bad:
            raise _unusable(ckpt_dir, nodes, epoch, bad[1][0])
        if saved(epoch) != replicas and not change_ok:
            raise _refuse_world(epoch, saved(epoch), replicas)
        return epoch, saved(epoch)
    before = None
    while True:
        latest, skipped = store.latest_complete_epoch(ckpt_dir, nodes, None, verify_hashes=False,
                                                      before=before)
        for e, why in skipped:
            _warn(said, f"warning: skipping checkpoint epoch {e}: {why}")
        if latest is None:
            raise _no_checkpoint(ckpt_dir)
        if saved(latest) != replicas and not change_ok:
            raise _refuse_world(latest, saved(latest), replicas)
        bad = problems(latest)
        if bad is None:
            return latest, saved(latest)
        _warn(said, f"warning: skipping checkpoint epoch {latest}: node {bad[0]!r}: {'; '.join(bad[1])}")
        before = latest


def _warn(said: list[str], line: str) -> None:
    said.append(line)
    print(line, file=sys.stderr)  # where every other warning goes


def _missing(ckpt_dir: Path, nodes: list[str], epoch: int) -> UsageError:
    """The named epoch was never saved here, or `keep` deleted it: bad input (exit 2); one
    that is there but damaged is a failure (exit 1, _unusable)."""
    done = store.complete_epochs(ckpt_dir, nodes)
    hint = (f"give one of the complete epochs: {', '.join(map(str, done))}" if done
            else f"no epoch in {ckpt_dir} is complete")
    return UsageError(f"no checkpoint of epoch {epoch} in {ckpt_dir}",
                      hint=f"{hint} (`{hints.command('ckpt list')}` shows them all)")


def _unusable(ckpt_dir: Path, nodes: list[str], epoch: int, why: str) -> CheckpointError:
    """The named epoch cannot be resumed from: say which others look complete (their
    files and markers are all there; the checksums are read when one is resumed)."""
    others = [e for e in store.complete_epochs(ckpt_dir, nodes) if e != epoch]
    hint = (f"complete epochs besides {epoch}: {', '.join(map(str, others))}" if others
            else f"no other complete epoch in {ckpt_dir}")
    return CheckpointError(f"checkpoint epoch {epoch} cannot be used: {why}",
                           hint=f"{hint} (`{hints.command('ckpt list')}` shows them all)")


def _pick_together(ckpt_dir: Path, nodes: list[str], replicas: int, epoch: int | None,
                   change_ok: bool, rank: int, gather: Gather, said: list[str]) -> tuple[int, int]:
    say = rank == 0

    def local_epochs() -> list[int]:
        return sorted({info.epoch for info in store.list_checkpoints(ckpt_dir)
                       if any(n in info.nodes for n in nodes)})

    def check(e: int, world: int | None, hashes: bool) -> list[str]:
        """What is wrong with the files this rank restores of epoch ``e``."""
        if world is None:
            return [f"rank {rank}: no checkpoint files of epoch {e} in {ckpt_dir}"]
        src = source_rank(rank, world)
        who = f"rank {rank}" if src == rank else f"rank {rank} (restores rank {src}'s files)"
        def found(node: str) -> list[str]:
            bad = store.verify(ckpt_dir, node, e, rank=src, hashes=hashes, decode=False)
            return bad if bad or not hashes else rng.saved_problems(ckpt_dir, node, e, [src])

        return [f"node {node!r}: {who}: {p}" for node in nodes for p in found(node)]

    candidates = [epoch] if epoch is not None else \
        sorted({e for theirs in gather(local_epochs()) for e in theirs}, reverse=True)
    for e in candidates:
        # Every process reads the world size from the manifests it has; they agree on it.
        mine = store.saved_world_size(ckpt_dir, nodes, e)
        found = gather([mine, check(e, mine, hashes=False)])
        worlds = {w for w, _ in found if w is not None}
        problems = [p for _, ps in found for p in ps]
        if len(worlds) > 1:
            problems.insert(0, f"the ranks' manifests disagree on the world size ({sorted(worlds)})")
        if not problems:
            world = worlds.pop()
            if world != replicas and not change_ok:
                raise _refuse_world(e, world, replicas)
            problems = [p for ps in gather(check(e, world, hashes=True)) for p in ps]
            if not problems:
                return e, world
        if epoch is not None:
            raise _unusable(ckpt_dir, nodes, e, problems[0])
        if say:
            _warn(said, f"warning: skipping checkpoint epoch {e}: {'; '.join(problems)}")
    raise _no_checkpoint(ckpt_dir)
