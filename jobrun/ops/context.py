"""What an op implementation sees of the running job.

An op implementation is a plain function ``impl(ctx, *inputs, **args)``. It returns the
value of its single output, a tuple of values when the call has several outputs, or None
when it has none. ``ctx`` is an :class:`OpContext`; torch is imported by the
implementations that need it, never here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class OpContext:
    """Per-node (and per-rank) facts and services handed to every op call."""

    node: str = "local"
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    device: str = "cpu"  # a torch device string: "cpu", "cuda", "cuda:1"
    parallel: str = "ddp"  # how replicas hold models: ddp (full copies) or fsdp (shards)
    fsdp_layers: tuple[str, ...] = ()  # fsdp: the module classes sharded as units
    fsdp_amp: str | None = None  # fsdp: bf16/fp16 parameters in the forward (plans.precision)
    plan_dir: Path = field(default_factory=Path.cwd)
    run_dir: Path = field(default_factory=Path.cwd)
    epoch: int = 0
    task: str = ""
    # log(values, msg): print and append one line to metrics.jsonl (set by the runner).
    log: Callable[[dict[str, Any], str | None, int], None] | None = None  # values, msg, step
    # load_checkpoint({blob: live value}, epoch): `checkpoint.load` (set by the runner).
    load_checkpoint: Callable[[dict[str, Any], int | str], None] | None = None
    # Shared with the live display: the innermost running loop's iteration (set by the runner).
    progress: dict[str, Any] | None = None
    _generator: Any = None
    # Per node: the task contexts copied from the node's share this dict (and the generator).
    _counters: dict[str, int] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def generator(self):
        """The node's seeded torch.Generator (CPU), created on first use.

        Seeded from (seed, node) so every node draws its own stream and every rank of
        one node draws the same one (parameters start identical on all ranks).
        """
        if self._generator is None:
            import torch

            self._generator = torch.Generator().manual_seed(node_seed(self.seed, self.node))
        return self._generator

    @property
    def step(self) -> int:
        """The global step: optimizer steps taken on this node so far (0 before the first).
        A counter of the node's, so checkpoints hold it and a resume goes on from it."""
        return self._counters.get(STEP_COUNTER, 0)

    def next_number(self, counter: str) -> int:
        """0, 1, 2, ... on successive calls: a per-node counter (e.g. readers number
        themselves in creation order). Counters are part of `state`, so a resumed job
        goes on counting where the checkpoint left off."""
        n = self._counters.get(counter, 0)
        self._counters[counter] = n + 1
        return n

    def state(self) -> dict[str, int]:
        """The node's counters, for a checkpoint (the generator is saved on its own)."""
        return dict(self._counters)

    def load_state(self, state: dict[str, int]) -> None:
        """Restore counters saved by `state`."""
        self._counters.update(state)

    def resolve_read(self, path: str) -> Path:
        """A path an op reads: relative ones are relative to the plan's directory."""
        return under(self.plan_dir, path)

    def resolve_write(self, path: str) -> Path:
        """A path an op writes: relative ones are relative to the run directory."""
        return under(self.run_dir, path)


def under(base: Path, path: str) -> Path:
    """``path`` (``~`` expanded) when absolute, else ``base / path``: how ops resolve the
    paths they read (against the plan's directory) and write (against the run directory)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


STEP_COUNTER = "step"  # the node's counter of optimizer steps (see OpContext.step)


def mix(*parts: object) -> int:
    """A stable 63-bit seed from its parts (Python's hash() is randomised per process):
    every seed jobrun derives (a node's, a reader's, a replica's) is one."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def node_seed(seed: int, node: str) -> int:
    """The seed of one node's generator."""
    return mix(seed, node)
