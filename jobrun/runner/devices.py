"""The device a process of a job computes on: ``auto``, ``cpu``, ``mps``, ``cuda`` or
``cuda:N``, checked before anything is written and chosen again in each worker."""

from __future__ import annotations

import os
from typing import Any

from jobrun.errors import UsageError


def device_for(wanted: str, world: int, select: bool = True) -> str:
    """The device this process uses; an unusable one is refused. ``select``: make it
    the current CUDA device (a worker), or only check it (before anything is written).

    ``auto`` is CUDA when there is a GPU, else Apple's MPS, else the CPU. With replicas,
    ``cuda`` gives each rank on a host its own GPU, ``cuda:LOCAL_RANK`` (NCCL); ``cuda:N``
    names one GPU for every rank, which replicas cannot share, and is refused.
    """
    if world > 1 and wanted.startswith("cuda:"):
        raise UsageError(f"device {wanted!r} names one GPU, but {world} replicas each need their own",
                         hint="use device cuda: rank r of a host runs on its GPU cuda:r (its LOCAL_RANK); "
                              "choose the GPUs with CUDA_VISIBLE_DEVICES")
    if not select and not wanted.startswith("cuda"):
        return wanted  # cpu and auto are always usable: no need to import torch yet
    import torch

    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "mps" if _mps(torch) else "cpu"
    if wanted.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"device {wanted!r} was asked for, but CUDA is not available here",
                             hint="use --device cpu")
        count = torch.cuda.device_count()
        if ":" in wanted and int(wanted.split(":")[1]) >= count:
            raise UsageError(f"device {wanted!r} was asked for, but this machine has {count} "
                             "CUDA device(s)", hint=f"use cuda:0 .. cuda:{count - 1}, or cpu")
        if world > 1 and wanted == "cuda":
            local = int(os.environ.get("LOCAL_RANK", 0))
            if local >= count:
                raise UsageError(f"rank {local} of this host has no GPU of its own: it has {count}",
                                 hint=f"run at most {count} replicas per host with device cuda")
            wanted = f"cuda:{local}"
        if select and ":" in wanted:  # plain `cuda` in one process: torch's current GPU
            torch.cuda.set_device(torch.device(wanted))
    return wanted


def _mps(torch: Any) -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())
