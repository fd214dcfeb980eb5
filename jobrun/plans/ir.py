"""The plan IR: small frozen dataclasses, every node carrying its source position.

The compiler builds it from YAML; the analyzer, the printer and the executor read it
through :mod:`jobrun.plans.visit`. It never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobrun.errors import Pos

GROUPS = ("init", "epoch", "download", "exit")


@dataclass(frozen=True, slots=True)
class BlobRef:
    """An input that names a blob."""

    name: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Literal:
    """An input given as a number or boolean literal (`mul: {in: [i, 10]}`)."""

    value: Any
    pos: Pos


Input = BlobRef | Literal


@dataclass(frozen=True, slots=True)
class OpCall:
    op: str
    ins: tuple[Input, ...]
    outs: tuple[BlobRef, ...]
    args: tuple[tuple[str, Any], ...]  # in source order
    pos: Pos
    arg_pos: tuple[tuple[str, Pos], ...] = ()
    id: str | None = None  # `id:` beside the op's name: a name overrides can address
    every: int | None = None  # `every: N`: runs at global steps 0, N, 2N, ...
    key_pos: tuple[tuple[str, Pos], ...] = ()  # where each argument's key is written

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)

    def pos_of(self, key: str) -> Pos:
        for k, p in self.arg_pos:
            if k == key:
                return p
        return self.pos

    def key_of(self, key: str) -> Pos:
        """Where argument `key` itself is written: an error about the key (one the op does
        not take) points there, not at its value, which an override may have given."""
        for k, p in self.key_pos:
            if k == key:
                return p
        return self.pos_of(key)


@dataclass(frozen=True, slots=True)
class Loop:
    """`loop: N | blob | null` with an optional `as` index blob."""

    count: int | BlobRef | None
    index: BlobRef | None
    body: tuple[Step, ...]
    pos: Pos
    id: str | None = None
    every: int | None = None  # `every: N`: runs at global steps 0, N, 2N, ...


@dataclass(frozen=True, slots=True)
class StopIf:
    cond: BlobRef
    pos: Pos
    id: str | None = None
    every: int | None = None  # `every: N`: runs at global steps 0, N, 2N, ...


@dataclass(frozen=True, slots=True)
class IfBranch:
    cond: BlobRef
    body: tuple[Step, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class If:
    """`if`/`elif`.../`else`: branches are tried in order."""

    branches: tuple[IfBranch, ...]
    orelse: tuple[Step, ...] | None
    pos: Pos
    id: str | None = None
    every: int | None = None  # `every: N`: runs at global steps 0, N, 2N, ...


@dataclass(frozen=True, slots=True)
class Branch:
    name: str | None
    body: tuple[Step, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Parallel:
    branches: tuple[Branch, ...]
    pos: Pos
    id: str | None = None
    every: int | None = None  # `every: N`: runs at global steps 0, N, 2N, ...


@dataclass(frozen=True, slots=True)
class Report:
    """Runs `body` every `period` seconds in the background, and once at the end."""

    period: float
    period_text: str
    body: tuple[Step, ...]
    pos: Pos
    id: str | None = None
    every: int | None = None  # `every: N`: runs at global steps 0, N, 2N, ...


Step = OpCall | Loop | StopIf | If | Parallel | Report


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    group: str
    node: str
    workspace: str  # "global" | "private"
    instances: int
    init: tuple[Step, ...]
    do: tuple[Step, ...]
    exit: tuple[Step, ...]
    outputs: tuple[BlobRef, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    tasks: tuple[Task, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Monitor:
    """An epoch-task output watched across epochs: `early_stop` and `checkpoint.best`."""

    name: BlobRef
    mode: str  # "min" | "max": which way is better

    def better(self, value: float, best: float | None, min_delta: float = 0.0) -> bool:
        """Whether `value` improves on `best` by more than `min_delta` (Lightning's rule)."""
        if best is None:
            return True
        return value < best - min_delta if self.mode == "min" else value > best + min_delta


@dataclass(frozen=True, slots=True)
class EarlyStop:
    """`early_stop:` stop after `patience` epochs in a row without an improvement of
    `monitor` larger than `min_delta`."""

    monitor: Monitor
    patience: int = 3
    min_delta: float = 0.0
    pos: Pos | None = None


@dataclass(frozen=True, slots=True)
class Best:
    """`checkpoint.best:` keep the `keep` best epochs by `monitor` beside the newest ones."""

    monitor: Monitor
    keep: int = 1
    pos: Pos | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    dir: str = "checkpoints"
    every: int = 1
    keep: int | None = None
    upload: str | None = None
    background: bool = False  # `async: true`: files are written while training goes on
    include: tuple[BlobRef, ...] = ()  # blobs saved besides those steps after init change
    exclude: tuple[BlobRef, ...] = ()  # blobs never saved (init rebuilds them)
    pos: Pos | None = None
    best: Best | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    job: str
    seed: int
    device: str
    replicas: int | str  # an int >= 1 or "auto"
    vars: dict[str, Any]
    max_epochs: int | None
    stop_when: tuple[BlobRef, ...]
    checkpoint: Checkpoint | None
    init: Group
    epoch: Group
    download: Group
    exit: Group
    source: str
    pos: Pos
    early_stop: EarlyStop | None = None
    max_restarts: int = 0  # times the elastic agent restarts the ranks after one died
    parallel: str = "ddp"  # ddp: a full model on every rank; fsdp: sharded with FSDP2
    fsdp_layers: tuple[str, ...] = ()  # module classes sharded as units (dotted paths)
    loggers: tuple[str, ...] = ()  # experiment trackers the logged values also go to
    loggers_pos: Pos | None = field(default=None, compare=False)  # where `loggers:` is
    fsdp_layers_pos: Pos | None = field(default=None, compare=False)  # where `fsdp_layers:` is
    max_steps: int | None = None  # stop once this many optimizer steps were taken (the global step)

    @property
    def groups(self) -> tuple[Group, ...]:
        return (self.init, self.epoch, self.download, self.exit)

    def tasks(self):
        for g in self.groups:
            yield from g.tasks

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node a task runs on, in order of first appearance."""
        seen: dict[str, None] = {}
        for t in self.tasks():
            seen.setdefault(t.node, None)
        return tuple(seen) or ("local",)
