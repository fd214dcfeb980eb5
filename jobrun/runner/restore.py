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
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from jobrun import hints, store
from jobrun.errors import CheckpointError, JobrunError
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
                                  hint=f"resume from another epoch (see `{hints.command('ckpt list')}`)")
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


def named(node: NodeRuntime, blobs: dict[str, Any], names: Collection[str], epoch: int) -> None:
    """`checkpoint.load`: the named blobs of what :func:`read` gave, into the live objects
    in place (the steps that read them hold the objects): a state as a resume loads it,
    a tensor copied into the live one; other values are refused, before any is loaded."""
    where = f"checkpoint epoch {epoch} of node {node.name!r}"
    held = sorted(b for b in blobs if b != rng.KEY)
    tensors = []
    for blob in names:
        if blob not in blobs:
            raise CheckpointError(
                f"{where} holds no blob {blob!r} (it holds {', '.join(map(repr, held)) or 'none'})",
                hint="checkpoints hold the blobs that steps after init change (docs/plan-language.md, "
                     "section 10); `checkpoint: {include: [...]}` adds one")
        saved, live = blobs[blob], node.globals.get(blob)
        if isinstance(saved, SavedState):
            continue
        if _shape(saved) is None or _shape(live) is None or isinstance(saved, shards.SavedShard):
            out = f"{blob}.{'json' if _shape(saved) is None else 'safetensors'}"
            raise CheckpointError(
                f"{where}, blob {blob!r}: checkpoint.load loads objects with a state (a model, an "
                f"optimizer) and tensors in place, and this blob holds {type(live).__name__}",
                hint=f"`{hints.command('export', '--epoch', str(epoch), '--node', node.name, '--blob', blob, '-o', out)}` "
                     "copies it out of the checkpoint")
        if (_shape(saved), _dtype(saved)) != (_shape(live), _dtype(live)):
            raise CheckpointError(
                f"{where}, blob {blob!r}: the checkpoint holds a tensor of {_dtype(saved)} "
                f"{list(_shape(saved) or ())}, the live one is {_dtype(live)} {list(_shape(live) or ())}",
                hint=_NEW_RUN_HINT)
        tensors.append((live, saved))
    for blob in names:
        if isinstance(blobs[blob], SavedState):
            _blob(node, blob, blobs[blob], epoch)
    if tensors:
        import torch

        with torch.no_grad():
            for live, saved in tensors:
                live.copy_(saved)


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
        _check_fits(node, blob, live, saved, epoch)
        try:
            store.restore(live, saved)  # its state dict, and a module's modes and frozen parameters
        except (JobrunError, ValueError, TypeError, KeyError) as e:  # a state the object refuses
            raise CheckpointError(
                f"checkpoint epoch {epoch}, blob {blob!r} on node {node.name!r}: its saved state does "
                f"not load: {e.message if isinstance(e, JobrunError) else e}",
                # a sharded model resumed without fsdp: the store's hint says how
                hint=e.hint if isinstance(e, shards.ShardMismatch) else
                "when the plan or an override (`resume vars.block=64`) changed what init builds, "
                "the run must start anew (`jobrun train PLAN --run-dir NEW`); otherwise the "
                f"checkpoint is damaged: resume from an earlier epoch (`{hints.resume_again('--epoch', str(epoch - 1))}`; "
                f"`{hints.command('ckpt list')}` shows them)") from None
        return
    node.globals[blob] = _to_device(saved, node.ctx.device)


_NEW_RUN_HINT = (
    "a checkpoint restores into the model init builds from the same plan: when the plan or an "
    "override (`resume vars.hidden=16`) changes a shape, the run must start anew "
    "(`jobrun train PLAN --run-dir NEW`); otherwise this checkpoint is from another plan or damaged")


def _check_fits(node: NodeRuntime, blob: str, live: Any, saved: SavedState, epoch: int) -> None:
    """Every tensor of a saved state dict has the shape and dtype of the live object's,
    and a module's saved keys are its own, before anything is loaded (torch would stop
    half-way with a size-mismatch traceback, or convert a dtype without a word)."""
    if not isinstance(saved.state, dict):
        return
    where = f"checkpoint epoch {epoch}, blob {blob!r} on node {node.name!r}"
    now = live.state_dict()
    if callable(getattr(live, "named_parameters", None)):  # a module: the same keys
        missing = [k for k in now if k not in saved.state]
        extra = [k for k in saved.state if k not in now]
        if missing or extra:
            parts = [f"{label} {', '.join(map(repr, keys[:4]))}{' ...' if len(keys) > 4 else ''}"
                     for label, keys in (("the model has no", extra), ("the checkpoint has no", missing))
                     if keys]
            raise CheckpointError(f"{where} does not fit the {type(live).__name__} init built: "
                                  + "; ".join(parts), hint=_NEW_RUN_HINT)
    for key, saved_v, live_v in [*_pairs(saved.state, now, ""), *_per_param(saved.state, live, where)]:
        s_shape, l_shape = _shape(saved_v), _shape(live_v)
        if s_shape != l_shape:
            raise CheckpointError(
                f"{where}, key {key!r}: the checkpoint holds a tensor of shape {list(s_shape)}, "
                f"the {type(live).__name__} init built has {list(l_shape)}", hint=_NEW_RUN_HINT)
        s_type, l_type = _dtype(saved_v), _dtype(live_v)
        if s_type != l_type:
            raise CheckpointError(
                f"{where}, key {key!r}: the checkpoint holds a tensor of {s_type}, the "
                f"{type(live).__name__} init built has {l_type}", hint=_NEW_RUN_HINT)


# The per-parameter buffers of torch's optimizers that have their parameter's shape
# (Adafactor's row/column factors, LBFGS's history and a 0-d `step` do not).
_LIKE_PARAM = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum",
                         "square_avg", "acc_delta", "grad_avg", "ax", "prev", "step_size"})


def _per_param(saved: dict[Any, Any], live: Any, where: str) -> Iterable[tuple[str, Any, Any]]:
    """An optimizer's saved per-parameter tensors (momentum, exp_avg...) against the live
    parameters they belong to: a fresh optimizer has no state to compare with, and torch
    would load them and fail at the first step."""
    groups, saved_groups, state = getattr(live, "param_groups", None), saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(saved_groups, list) or not isinstance(state, dict):
        return
    params = [p for g in groups for p in g["params"]]
    ids = [i for g in saved_groups if isinstance(g, dict) for i in g.get("params", ())]
    if len(ids) != len(params):
        raise CheckpointError(f"{where}: the checkpoint's {type(live).__name__} holds {len(ids)} parameters, "
                              f"the one init built {len(params)}", hint=_NEW_RUN_HINT)
    for i, p in zip(ids, params):
        for name, v in (state.get(i) or {}).items() if isinstance(state.get(i), dict) else ():
            if name in _LIKE_PARAM and _shape(v) is not None:
                yield f"state.{i}.{name}", v, p.detach()


def _pairs(saved: Any, live: Any, path: str) -> Iterable[tuple[str, Any, Any]]:
    """(key path, saved, live) for every tensor both state dicts hold at the same place."""
    if isinstance(saved, dict) and isinstance(live, dict):
        for k, v in saved.items():
            if k in live:
                yield from _pairs(v, live[k], f"{path}.{k}" if path else str(k))
    elif _shape(saved) is not None and _shape(live) is not None:
        yield path, saved, live


def _shape(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, shards.SavedShard):
        return v.shape  # the whole tensor's (a DTensor's shape is too)
    try:
        shape = getattr(v, "shape", None)
    except (ValueError, RuntimeError):  # a lazy module's parameter has none yet: torch fills it
        return None
    return tuple(shape) if shape is not None and hasattr(v, "dtype") else None


def _dtype(v: Any) -> str:
    dtype = (v.local if isinstance(v, shards.SavedShard) else v).dtype
    return str(dtype).removeprefix("torch.")


def _to_device(value: Any, device: str) -> Any:
    if device == "cpu":
        return value
    to = getattr(value, "to", None)
    if to is not None and type(value).__module__.startswith("torch"):
        return to(device)
    return value
