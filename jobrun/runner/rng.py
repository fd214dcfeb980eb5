"""The random state a checkpoint holds for each node: Python's, numpy's and torch's global
generators, the node's own generator, and the node's counters (reader numbers).

A checkpoint's random state is checked before anything is restored from it: a state that
a generator would refuse (or a damaged one that checksums cannot see, because it was
re-sealed) makes the checkpoint invalid, so resume skips it instead of failing half-way.
Each part is checked by loading it into a scratch generator of its kind (so `ckpt list
--verify`, which checks them too, imports torch; the listing without --verify does not).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

KEY = "jobrun:rng"


def capture(ctx: Any) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "node": ctx.generator.get_state(),
        # readers made inside epoch tasks number themselves from these counters
        "ctx_state": ctx.state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def problems(state: Any) -> list[str]:
    """What would keep ``state`` from being restored ([] when it can be)."""
    if not isinstance(state, dict):
        return [f"the random state is {type(state).__name__}, not a mapping"]
    # A stream still where init left it is not stored but named (see runner/fingerprint.py).
    unchanged = state.get("unchanged", [])
    if not isinstance(unchanged, list) or not all(isinstance(p, str) for p in unchanged):
        return ["the random state is damaged: its list of unchanged streams"]
    found = [f"the random state has no {key!r} part" for key in ("python", "numpy", "torch", "node")
             if key not in state and key not in unchanged]
    if found:
        return found
    if "python" in state:
        try:
            random.Random().setstate(_python(state["python"]))
        except (TypeError, ValueError, IndexError, OverflowError) as e:
            found.append(f"the random state is damaged: Python's ({e})")
    if "numpy" in state:
        try:
            np.random.RandomState().set_state(_numpy(state["numpy"]))
        except (TypeError, ValueError, IndexError, OverflowError) as e:
            found.append(f"the random state is damaged: numpy's ({e})")
    for key in ("torch", "node"):
        if key in state and (problem := _torch_problem(state[key])):
            found.append(f"the random state is damaged: the {key} generator's ({problem})")
    counters = state.get("ctx_state", {})
    if not (isinstance(counters, dict)
            and all(isinstance(v, int | float | str) and not isinstance(v, bool) for v in counters.values())):
        found.append("the random state is damaged: the node's counters")
    return found


def saved_problems(ckpt_dir: Any, node: str, epoch: int, ranks: list[int]) -> list[str]:
    """What keeps the random states of these ranks of a saved epoch from being restored.
    Reads only them (the store checks the rest)."""
    from jobrun import store
    from jobrun.errors import CheckpointError

    found: list[str] = []
    for rank in ranks:
        try:
            blobs, _ = store.load(ckpt_dir, node, epoch, rank=rank, verify_hashes=False, blobs=[KEY])
        except CheckpointError as e:
            found.append(e.message)
            continue
        found += [f"rank {rank}: {p}" for p in problems(blobs.get(KEY))]
    return found


def restore(ctx: Any, state: dict[str, Any]) -> None:
    """Restore the streams a checkpoint holds (one it lacks is still where init left it)."""
    import torch

    if "python" in state:
        random.setstate(_python(state["python"]))
    if "numpy" in state:
        np.random.set_state(_numpy(state["numpy"]))
    if "torch" in state:
        torch.set_rng_state(_as_bytes(state["torch"]))
    if "node" in state:
        ctx.generator.set_state(_as_bytes(state["node"]))
    ctx.load_state(state.get("ctx_state", {}))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_as_bytes(s) for s in state["cuda"]])


def _python(py: Any) -> tuple:
    version, internal, gauss = py  # a JSON round trip makes the tuples lists
    return (version, tuple(internal), gauss)


def _numpy(state: Any) -> tuple:
    return tuple(state)


def _torch_problem(value: Any) -> str | None:
    import torch

    try:
        torch.Generator().set_state(_as_bytes(value))
    except (RuntimeError, TypeError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


def _as_bytes(x: Any) -> Any:
    import torch

    # A private, aligned copy: a tensor read from a checkpoint may view an unaligned buffer.
    return x.clone() if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.uint8)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators, as every process of a run
    starts (before init; a resume then restores the checkpoint's streams)."""
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def replica_seed(seed: int, rank: int, epoch: int | None = None) -> int:
    """The seed replica `rank` (> 0) gives its global generators once init is done
    (`jobrun.replica_seed`); ``epoch``: a replica that a resume onto more replicas adds
    after that epoch, which has no streams of its own to restore."""
    from jobrun.ops.context import mix

    return mix(seed, "replica", rank) if epoch is None else mix(seed, "replica", rank, "resumed", epoch)


def seed_replica(seed: int, rank: int, epoch: int | None = None) -> None:
    """Give replica `rank` streams of its own: init drew alike on every replica (so each
    built the same models), the epochs' draws in the forward (dropout) and in the user's
    code must not. Replica 0 keeps the streams init left, those of a run of one process."""
    import torch

    if rank == 0:
        return
    value = replica_seed(seed, rank, epoch)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # and every GPU's generator
