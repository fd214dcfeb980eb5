"""Sharded tensors (torch DTensors, as FSDP2 makes them) in checkpoints.

Each rank saves the shard it holds (``DTensor.to_local()``) as an ordinary tensor of its
own checkpoint, with JSON facts beside it: the global shape and stride, the placements
(``S0`` = sharded on dim 0, ``R`` = replicated) and the number of ranks of the mesh. So a
sharded checkpoint keeps the store's protocol (atomic, checksummed, no pickle), and every
rank writes and reads only its part.

On restore the saved shard becomes a DTensor again on the live object's mesh
(:func:`relive`), with the same number of ranks. :func:`assemble` rebuilds the full
tensor from every rank's shard, for `export` and `ckpt show` of a whole model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import numpy as np

from jobrun import records_schema
from jobrun.errors import CheckpointError


@dataclass(frozen=True)
class SavedShard:
    """One rank's part of a sharded tensor, as a checkpoint holds it."""

    local: Any  # the rank's shard: a CPU tensor (or an ndarray when read without torch)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: int  # ranks of the mesh it was sharded over


def is_dtensor(t: Any) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def facts(t: Any) -> dict[str, Any]:
    """The JSON facts of a DTensor, beside its local shard."""
    placements = []
    for p in t.placements:
        if p.is_shard():
            placements.append(f"S{p.dim}")
        elif p.is_replicate():
            placements.append("R")
        else:
            raise CheckpointError(f"cannot checkpoint a DTensor placed as {p}",
                                  hint="jobrun saves tensors sharded on one dimension or replicated")
    return {"shape": list(t.shape), "stride": list(t.stride()), "placements": placements,
            "mesh": int(t.device_mesh.size())}


def saved(local: Any, f: Any) -> SavedShard:
    """A SavedShard from a decoded local tensor and its facts, checked against the
    schema and against the local tensor (data, not code): a placement must name a
    dimension the tensor has, and the local shard must be a part of the global shape."""
    try:
        f = records_schema.check(f, records_schema.SHARD_FACTS)
    except records_schema.Invalid as e:
        _damaged(f"a sharded tensor's facts are damaged: {e}")
    shape, stride, placements = tuple(f["shape"]), tuple(f["stride"]), tuple(f["placements"])
    if len(stride) != len(shape):
        _damaged(f"a sharded tensor's stride {list(stride)} does not fit its shape {list(shape)}")
    local_shape = tuple(getattr(local, "shape", ()))
    if placements == ("R",):
        expected = shape
    else:
        dim = int(placements[0][1:])
        if dim >= len(shape):
            _damaged(f"a sharded tensor is placed on dimension {dim}, but its shape {list(shape)} "
                     f"has {len(shape)} dimension(s)")
        part = -(-shape[dim] // f["mesh"])  # torch.chunk's size
        expected = (*shape[:dim], min(local_shape[dim], part) if len(local_shape) > dim else part,
                    *shape[dim + 1:])
    if local_shape != expected:
        _damaged(f"a shard of shape {list(local_shape)} is no part of a tensor of shape {list(shape)} "
                 f"placed {placements[0]} over {f['mesh']} ranks")
    return SavedShard(local, shape, stride, placements, f["mesh"])


class ShardMismatch(CheckpointError):
    """A sharded checkpoint resumed by a run that shards otherwise: its hint says how."""


def _damaged(what: str) -> NoReturn:
    raise CheckpointError(what, hint="the checkpoint is damaged; resume from another epoch")


def relive(state: Any, live: Any) -> Any:
    """``state`` with every SavedShard made a DTensor on ``live``'s mesh again."""
    mesh = None

    def walk(v: Any) -> Any:
        nonlocal mesh
        if isinstance(v, SavedShard):
            if mesh is None:
                mesh = _mesh_of(live)
            if mesh is None or mesh.size() != v.mesh:
                have = "no sharded parameters" if mesh is None else f"{mesh.size()} ranks"
                raise ShardMismatch(
                    f"the checkpoint holds a model sharded over {v.mesh} ranks; this run has {have}",
                    hint=f"resume an fsdp run with {v.mesh} replicas (--replicas {v.mesh}); "
                         "jobrun export writes the whole model from a sharded checkpoint",
                )
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in v.placements]
            return DTensor.from_local(v.local, mesh, placements, shape=v.shape, stride=v.stride,
                                      run_check=False)
        if isinstance(v, dict):
            out = type(v)((k, walk(x)) for k, x in v.items())
            if hasattr(v, "_metadata"):
                out._metadata = v._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    return _fit(walk(state), live)


def _fit(state: Any, live: Any) -> Any:
    """Whole tensors (a checkpoint of another number of ranks, made whole by
    :func:`whole`, or of one replica) given to a live sharded module or optimizer: each
    rank keeps its own part of each, as FSDP2 shards (torch.chunk on the same dims)."""
    mesh = _mesh_of(live)
    if mesh is None or not isinstance(state, dict):
        return state
    from torch.distributed.tensor import distribute_tensor

    def part(v: Any, like: Any) -> Any:
        if is_dtensor(like) and not is_dtensor(v) and hasattr(v, "shape") and tuple(v.shape) == tuple(like.shape):
            return distribute_tensor(v, mesh, like.placements, src_data_rank=None)
        return v

    if callable(getattr(live, "named_parameters", None)):  # a module
        now = live.state_dict()
        return type(state)((k, part(v, now.get(k))) for k, v in state.items())
    groups = getattr(live, "param_groups", None)
    saved_groups = state.get("param_groups")
    if groups is None or not isinstance(saved_groups, list) or not isinstance(state.get("state"), dict):
        return state
    params = dict(zip((i for g in saved_groups for i in g.get("params", ())),
                      (p for g in groups for p in g["params"])))
    per_param = {i: {k: part(v, params.get(i)) for k, v in s.items()} if isinstance(s, dict) else s
                 for i, s in state["state"].items()}
    return {**state, "state": per_param}


def _mesh_of(live: Any) -> Any:
    """The device mesh of the first DTensor parameter of a module or an optimizer."""
    params = []
    if callable(getattr(live, "parameters", None)):
        params = list(live.parameters())
    for group in getattr(live, "param_groups", ()):
        params += list(group["params"])
    for p in params:
        if is_dtensor(p):
            return p.device_mesh
    return None


def holds_shards(tree: Any) -> bool:
    """Whether a decoded checkpoint tree holds a SavedShard anywhere."""
    if isinstance(tree, SavedShard):
        return True
    state = getattr(tree, "state", None)  # a SavedState
    if state is not None:
        return holds_shards(state)
    if isinstance(tree, dict):
        return any(holds_shards(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return any(holds_shards(v) for v in tree)
    return False


def whole(trees: list[Any]) -> Any:
    """Rank 0's tree (``trees``: every rank's, in rank order) with each SavedShard made
    whole from the same place in every rank's tree."""
    first = trees[0]
    if isinstance(first, SavedShard):
        return assemble(trees)
    state = getattr(first, "state", None)
    if state is not None:
        return replace(first, state=whole([t.state for t in trees]))
    if isinstance(first, dict):
        out = type(first)((k, whole([t[k] for t in trees])) for k in first)
        if hasattr(first, "_metadata"):
            out._metadata = first._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(first, list | tuple):
        return type(first)(whole([t[i] for t in trees]) for i in range(len(first)))
    return first


def assemble(shards: list[SavedShard]) -> Any:
    """The full tensor from every rank's shard (in rank order), as torch.chunk split it."""
    first = shards[0]
    if len(shards) != first.mesh or not all(isinstance(s, SavedShard) for s in shards):
        raise CheckpointError(f"a sharded tensor needs the files of all {first.mesh} ranks; "
                              f"{len(shards)} found", hint="copy every rank's checkpoint here")
    for r, s in enumerate(shards):
        if (s.shape, s.placements, s.mesh) != (first.shape, first.placements, first.mesh):
            _damaged(f"rank {r}'s shard of a tensor is of shape {list(s.shape)} placed "
                     f"{s.placements[0]} over {s.mesh} ranks; rank 0's of {list(first.shape)} placed "
                     f"{first.placements[0]} over {first.mesh}")
    if first.placements == ("R",):
        return first.local
    dim = int(first.placements[0][1:])
    try:
        if all(isinstance(s.local, np.ndarray) for s in shards):  # read without torch
            full = np.concatenate([s.local for s in shards], axis=dim)
        else:
            import torch

            full = torch.cat([torch.as_tensor(s.local) for s in shards], dim=dim)
    except (ValueError, RuntimeError, TypeError) as e:
        _damaged(f"the shards of a tensor of shape {list(first.shape)} do not fit together: {e}")
    if tuple(full.shape) != first.shape:
        raise CheckpointError(f"the shards of a tensor make {tuple(full.shape)}, not {first.shape}",
                              hint="the checkpoint is damaged; resume from another epoch")
    return full
