"""Op signatures as frozen data: what `print`, `analyze` and `ops` know without torch.

An :class:`OpSpec` names an op's inputs, outputs and typed arguments, a one-line doc and
the import path of its implementation ("module:function"), resolved only when a job runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Argument types understood by the compiler's checks:
#   "int", "float" (an int is accepted too), "number" (int or float), "bool", "str",
#   "int>=N", "number>=N", "number>N" (sizes and rates with a lower bound, e.g. "int>=1":
#   a value below it is refused before a run; see `bounded`),
#   "list", "dict", "shape" (list of ints >= 0, at most 2**34 elements in all),
#   "sizes" (a non-empty list of ints >= 1, e.g. layer widths), "any", "duration",
#   "loss" (one of LOSS_NAMES, or a dotted path: "pkg.mod:fn"),
#   ("choice", "a", "b", ...) - one of the listed strings,
#   ("or", T1, T2, ...) - any of the listed types; "null" allows None.
ArgType = Any

REQUIRED = object()  # default marker: the argument must be given
LOSS_NAMES = ("cross_entropy", "mse", "model")  # the losses known by name (jobrun.ops.losses)


@dataclass(frozen=True, slots=True)
class ArgSpec:
    name: str
    type: ArgType = "any"
    default: Any = REQUIRED
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One op's signature.

    ``inputs``/``outputs`` name the fixed positions. ``min_inputs``/``max_inputs`` (and
    the same for outputs) bound how many a call may give; ``None`` as a maximum means any
    number ("add" sums any number of inputs). ``extra_args`` lets a call pass keys the
    spec does not list (``optimizer`` hands them to torch).
    """

    name: str
    doc: str
    impl: str  # "package.module:function"
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    args: tuple[ArgSpec, ...] = ()
    min_inputs: int | None = None  # default: len(inputs)
    max_inputs: int | None | str = "fixed"  # "fixed": len(inputs); None: unbounded
    min_outputs: int | None = None
    max_outputs: int | None | str = "fixed"
    extra_args: bool = False
    category: str = "core"  # "core", "training", "user"
    example: str = ""
    # What checkpoints need (jobrun/plans/state.py). `mutates`: the inputs the op changes
    # in place, by name (the last name of a variadic op covers the inputs after it).
    # `keeps`: the inputs its output holds on to and changes when it is changed itself
    # (a scheduler sets its optimizer's learning rate). None, the default: not declared,
    # so every input (users' ops, whose code jobrun cannot see).
    mutates: tuple[str, ...] | None = None
    keeps: tuple[str, ...] | None = None
    # "package.module:function": given the run's context and a call site's arguments, the
    # op bound to them (a function of the inputs only), or None (jobrun/ops/bound.py).
    bind: str | None = None
    _arg_index: dict[str, ArgSpec] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_arg_index", {a.name: a for a in self.args})

    def arg(self, name: str) -> ArgSpec | None:
        return self._arg_index.get(name)

    def input_names(self, n: int) -> list[str]:
        """The signature's name of each of `n` inputs of a call."""
        if not self.inputs:
            return [""] * n
        last = len(self.inputs) - 1
        return [self.inputs[min(i, last)] for i in range(n)]

    @property
    def input_bounds(self) -> tuple[int, int | None]:
        lo = len(self.inputs) if self.min_inputs is None else self.min_inputs
        hi = len(self.inputs) if self.max_inputs == "fixed" else self.max_inputs
        return lo, hi  # type: ignore[return-value]

    @property
    def output_bounds(self) -> tuple[int, int | None]:
        lo = len(self.outputs) if self.min_outputs is None else self.min_outputs
        hi = len(self.outputs) if self.max_outputs == "fixed" else self.max_outputs
        return lo, hi  # type: ignore[return-value]


def arg(name: str, type: ArgType = "any", default: Any = REQUIRED, doc: str = "") -> ArgSpec:
    return ArgSpec(name, type, default, doc)


_BOUNDED = re.compile(r"(int|number)(>=|>)(-?\d+(?:\.\d+)?)")


def bounded(t: ArgType) -> tuple[str, str, float] | None:
    """("int", ">=", 1.0) for the type "int>=1": an int or a number with a lower bound."""
    m = _BOUNDED.fullmatch(t) if isinstance(t, str) else None
    return (m[1], m[2], float(m[3])) if m else None
