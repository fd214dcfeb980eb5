"""The process group of a data-parallel job: start it, share facts, agree on a stop.

Every rank of a job joins one torch.distributed process group (gloo on CPU, nccl on
CUDA). Besides the training collectives (:mod:`jobrun.ops.dist`), the runner uses it to

- hand rank 0's plan and run settings to the other ranks, through the rendezvous store
  before the process group exists (:func:`publish`, :func:`fetch`), so that hosts need no
  shared filesystem;
- let every rank tell the others what it found (:func:`gather`), e.g. which checkpoint
  epochs it can restore, so that all pick the same one;
- agree on a SIGINT/SIGTERM that reached some ranks (:func:`agree_on_stop`), so that all
  stop at the same point and none waits in a collective for one that left.

Facts travel as JSON (in the store, or in uint8 tensors), never as pickles: a peer's
bytes are decoded as data only. torch is imported inside the functions (the CLI imports this module lazily).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

from jobrun import signals
from jobrun.errors import env_seconds


def timeout() -> timedelta:
    return timedelta(seconds=env_seconds("JOBRUN_DIST_TIMEOUT"))


def start(device: str, store: Any = None) -> None:
    """Join the job's process group, through the rendezvous store (``store``: the caller
    has connected to it already)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    rank = int(os.environ["RANK"])
    with signals.meeting(say=rank == 0):  # a launcher killed meanwhile ends this rank at once
        dist.init_process_group(backend=backend, timeout=timeout(), store=store or rendezvous_store(),
                                rank=rank, world_size=int(os.environ["WORLD_SIZE"]))


def finish() -> None:
    """All ranks meet once more before they leave: a rank that tore its gloo connections
    down while another still used them made that one abort at exit ("terminate called
    without an active exception", seen once under torchrun)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def stop() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - shutting down anyway
        pass


def _device() -> Any:
    import torch
    import torch.distributed as dist

    # nccl moves CUDA tensors only; gloo CPU ones.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def _encode(obj: Any) -> Any:
    import torch

    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _decode(t: Any) -> Any:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())


def rendezvous_store() -> Any:
    """A client of the store of the job's rendezvous: torchrun's (or our launcher's)
    elastic agent hosts it at MASTER_ADDR:MASTER_PORT; without an agent, rank 0 does
    (as torch.distributed.rendezvous does for init_process_group).

    The agent keeps one store for all the restarts of its workers, where the keys of the
    ranks that died are still found: the process group of a restarted set of ranks must
    not read them (gloo would connect to a dead rank's address), so each restart uses
    keys of its own."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    first = int(os.environ["RANK"]) == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=first and not agent,
                          timeout=timeout(), wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"jobrun/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{restart}/", store)


def publish(store: Any, name: str, obj: Any) -> None:
    """Put JSON data in the rendezvous store (rank 0, for the others to :func:`fetch`)."""
    store.set(name, json.dumps(obj))


def fetch(store: Any, name: str) -> Any:
    """What rank 0 published under ``name``, once it is there (up to the timeout)."""
    return json.loads(store.get(name).decode())


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON data), in rank order, on every rank."""
    import torch
    import torch.distributed as dist

    dev = _device()
    mine = _encode(obj).to(dev)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=dev))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: mine.numel()] = mine
    slots = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(slots, padded)
    return [_decode(slot[: int(n.item())]) for slot, n in zip(slots, sizes)]


def agree_on_stop(failed_epoch: int | None = None) -> tuple[int, int | None]:
    """Raise Interrupted on every rank when a signal reached any of them (one all-reduce
    of three numbers; called where all ranks pass together, after each save). Returns
    how many ranks' saves failed and the epoch (``failed_epoch``: this rank's failed
    save), which rank 0 reports."""
    import torch
    import torch.distributed as dist

    failed = failed_epoch is not None
    vals = [signals.flag(), float(failed), float(failed_epoch or 0)]
    reduced = torch.tensor(vals, dtype=torch.float64, device=_device())
    dist.all_reduce(reduced)
    flag, count, epochs = reduced.tolist()
    signals.agree(flag)
    return int(count), (round(epochs / count) if count else None)


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` comes from a collective that broke because another rank is gone
    (gloo: its connection closed; nccl: a remote error). The launcher names that rank."""
    import torch.distributed as dist

    seen: BaseException | None = error
    for _ in range(8):  # the chain of causes: an op's error wraps torch's
        if seen is None:
            return False
        if isinstance(seen, dist.DistNetworkError) or any(
                what in str(seen) for what in ("closed by peer", "reset by peer", "Broken pipe")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_FAILURE_KEY = "jobrun/failure"
_MAX_FAILURE_CHARS = 1 << 16
_SEEN_WAIT_S = 5.0


def tell_failure(rank: int, text: str) -> None:
    """Leave this rank's error message in the process group's store, for the ranks whose
    collectives break when this one leaves (another host prints the same message, not
    its own broken connection). The first rank to fail sets it; a store gone is ignored."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            store.compare_set(_FAILURE_KEY, "", json.dumps({"rank": rank, "message": text[:_MAX_FAILURE_CHARS]}))
            if int(os.environ.get("LOCAL_WORLD_SIZE", "0")) < dist.get_world_size():
                # A while for a rank of another host to read it: when this host's launcher
                # holds the store, it goes when this rank has ended. (On one host every
                # rank's console is this one's, and the others wait in a collective for this
                # rank to leave: they could not read it before; the wait cost 5 s.)
                store.wait([_FAILURE_KEY + "/seen"], timedelta(seconds=_SEEN_WAIT_S))
    except Exception:  # noqa: BLE001 - the message is printed here anyway; nobody read it in time
        pass


def peer_failure(wait_s: float = 5.0) -> tuple[int, str] | None:
    """(rank, message) of the rank whose failure broke this one's collective, when it
    told it (:func:`tell_failure`) within ``wait_s`` seconds; else None."""
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        store.wait([_FAILURE_KEY], timedelta(seconds=wait_s))
        told = json.loads(store.get(_FAILURE_KEY).decode())
        store.set(_FAILURE_KEY + "/seen", "1")
        rank, message = told["rank"], told["message"]
        if type(rank) is int and isinstance(message, str):
            return rank, message[:_MAX_FAILURE_CHARS]
    except Exception:  # noqa: BLE001 - a store gone, a timeout, damaged data: not told
        pass
    return None
