"""What the functions :mod:`jobrun.runner.codegen_task` generates call while they run:
the checks of an op's results and of a loop's count, and a loop's mean loss (the losses of
its train.steps kept as they are, device tensors, and summed by torch at the loop's end).
"""

from __future__ import annotations

from typing import Any

from jobrun.errors import RunError
from jobrun.plans import ir

# A loop's mean loss sums its steps' losses by blocks of this many (the losses of a block
# are kept until it is summed: a few hundred bytes each, 512 on a GPU).
MEAN_BLOCK = 1024


def loss_sum(losses: list[Any]) -> Any:
    """torch's float32 sum of a block of train.step losses (0-d tensors on one device)."""
    import torch

    return torch.stack(losses).sum()


def loss_mean(blocks: list[Any], losses: list[Any]) -> Any:
    """The mean of a loop's train.step losses: the sum of its blocks' sums (and of the
    last, unfinished block) over the steps. Rounding: torch's sum of the stacked float32
    losses (pairwise on the CPU, a tree on a GPU), not a left-to-right sum; a few units in
    the last place of float32 apart."""
    n = len(blocks) * MEAN_BLOCK + len(losses)
    if losses:
        blocks = [*blocks, loss_sum(losses)]
    return (blocks[0] if len(blocks) == 1 else loss_sum(blocks)) / n


def results(result: Any, n: int) -> tuple[Any, ...]:
    """An op's results for `n` outputs (a tuple or a list of n values), or why not."""
    got = len(result) if isinstance(result, tuple | list) else 1
    if got != n:
        raise RunError(f"op returned {got} value(s) for {n} outputs", hint=_COUNT_HINT)
    return tuple(result)


_COUNT_HINT = ("give `out` one name for each value the op returns (`jobrun ops NAME` says what it "
               "returns): a `read` gives its reader's fields, then `done` (which may be left out); "
               "a `data.load` one array per name (`keys` picks them); a `call` what your function returns")


def as_int(n: Any, s: ir.Loop) -> int:
    if hasattr(n, "item") and getattr(n, "numel", lambda: 0)() == 1:
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        name = s.count.name if isinstance(s.count, ir.BlobRef) else "its count"
        raise RunError(
            f"loop count is {'null' if n is None else repr(n)}, not a non-negative integer", s.pos,
            f"give blob {name!r} a whole number >= 0 (or a one-element integer tensor) before the "
            "loop starts, e.g. - const: {out: " + name + ", value: 3}",
        )
    return n
