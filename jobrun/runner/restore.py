"""Reading a checkpoint back into a job's nodes (resume, and a restart after a rank died).

    read: for every node, its files of the epoch (this rank's, or rank 0's for a rank the
          checkpoint has none of), checked: the world size that wrote them, init's
          fingerprint (the caller's check), the random state; sharded tensors made whole
          from every saved rank when the number of ranks changed
    into: then each node's blobs and random state, once every node's files passed

Nothing is restored until every node's checkpoint has been read and checked, so a bad
file leaves the job as init built it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jobrun import store
from jobrun.errors import CheckpointError
from jobrun.runner import rng
from jobrun.runner.executor import NodeRuntime
from jobrun.store import SavedState, shards


def read(
    ckpt_dir: Path, nodes: Iterable[str], epoch: int, *, rank: int, world_size: int,
    saved_world: int | None, hashes: bool, check_init: Callable[[str, dict[str, Any], int], None],
) -> tuple[dict[str, tuple[dict[str, Any], float]], dict[str, Any]]:
    """({node: (blobs, seconds to read)}, the last node's meta). ``saved_world``: the
    ranks that wrote the epoch when it is not ``world_size`` (resume --replicas)."""
    meta: dict[str, Any] = {}
    loaded: dict[str, tuple[dict[str, Any], float]] = {}
    # A checkpoint of N ranks restored into another number (resume --replicas): a rank
    # it has no files of restores rank 0's (see runner/pick.py).
    world = saved_world or world_size
    source = rank if rank < world else 0
    for name in nodes:
        t0 = time.perf_counter()
        blobs, meta = store.load(ckpt_dir, name, epoch, rank=source, verify_hashes=hashes)
        wrote = meta.get("world_size") if isinstance(meta, dict) else None
        if wrote not in (None, world):
            from jobrun.runner.pick import replicas_text

            raise CheckpointError(
                f"checkpoint epoch {epoch} was written by {replicas_text(wrote)}; this run "
                f"has {world_size}",
                hint=f"resume with {replicas_text(wrote)} (--replicas {wrote})")
        check_init(name, meta, epoch)
        if found := rng.problems(blobs.get(rng.KEY)):
            raise CheckpointError(f"checkpoint epoch {epoch} of node {name!r}: {found[0]}",
                                  hint="resume from another epoch (see `jobrun ckpt list`)")
        if world != world_size and shards.holds_shards(blobs):
            # Another number of ranks: every saved rank's shards, made whole (each rank
            # then takes its part; see shards.relive).
            blobs = {**blobs, **shards.whole([
                {b: v for b, v in blobs.items() if b != rng.KEY} if r == source else
                store.load(ckpt_dir, name, epoch, rank=r, verify_hashes=hashes,
                           blobs=[b for b in blobs if b != rng.KEY])[0]
                for r in range(world)])}
        loaded[name] = blobs, time.perf_counter() - t0
    return loaded, meta


def into(node: NodeRuntime, blobs: dict[str, Any], epoch: int) -> None:
    """Restore a node's blobs and random state from what :func:`read` gave."""
    state = blobs.pop(rng.KEY)
    for blob, saved in blobs.items():
        _blob(node, blob, saved, epoch)
    rng.restore(node.ctx, state)


def _blob(node: NodeRuntime, blob: str, saved: Any, epoch: int) -> None:
    live = node.globals.get(blob)
    if isinstance(saved, SavedState):
        loader = getattr(live, "load_state_dict", None)
        if loader is None:
            raise CheckpointError(
                f"checkpoint epoch {epoch} holds the state of a {saved.type_name} for blob "
                f"{blob!r} on node {node.name!r}, but init did not create one",
                hint="init must build every object the epochs use (the plan changed?)",
            )
        store.restore(live, saved)  # its state dict, and a module's modes and frozen parameters
        return
    node.globals[blob] = _to_device(saved, node.ctx.device)


def _to_device(value: Any, device: str) -> Any:
    if device == "cpu":
        return value
    to = getattr(value, "to", None)
    if to is not None and type(value).__module__.startswith("torch"):
        return to(device)
    return value
