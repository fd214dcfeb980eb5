"""The global step: the optimizer steps a node has taken, counted as they happen.

One hook of torch's, registered once per process
(`torch.optim.optimizer.register_optimizer_step_post_hook`), runs after every optimizer
step, whoever calls it: `train.step`, a `call` to the user's own loop, a GradScaler (a
step it skips for an inf is not taken, so not counted). It adds one to the node counter
of the task that is running (a context variable the executor sets for a task's run and
hands to the threads it starts), so every node counts its own steps, and nothing counts
outside a task. The count is a counter of the node's (`OpContext.step`), saved in every
checkpoint with the random state and restored on resume.

`every` is the rule of a step with `every: N`: it runs when the clock it sees (the step at
which its loop's iteration began, or the step now outside loops) is a multiple of N, once
per clock value: a loop that takes no optimizer step does not run it again and again.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from jobrun.ops.context import STEP_COUNTER

_COUNTERS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "jobrun_step_counters", default=None)
_WATCHED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("jobrun_stepped", default=None)
_lock = threading.Lock()
_installed = False


def install() -> None:
    """Count optimizer steps from now on in this process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_stepped)
        _installed = True


def _stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    counters = _COUNTERS.get()
    if counters is not None:
        counters[STEP_COUNTER] = counters.get(STEP_COUNTER, 0) + 1
    stepped = _WATCHED.get()
    if stepped is not None and not any(o is optimizer for o in stepped):
        stepped.append(optimizer)


@contextlib.contextmanager
def stepped() -> Iterator[list[Any]]:
    """The optimizers stepped in this context while the block runs, each once (a `call`
    checks them against what it says it changes). Empty where `install` was not called."""
    seen: list[Any] = []
    token = _WATCHED.set(seen)
    try:
        yield seen
    finally:
        _WATCHED.reset(token)


def counting(counters: dict[str, Any]) -> contextvars.Token:
    """Optimizer steps taken in this context from now on count in `counters` (a node's);
    give the token back to `stop_counting`."""
    return _COUNTERS.set(counters)


def stop_counting(token: contextvars.Token) -> None:
    _COUNTERS.reset(token)


def every(counters: dict[str, Any], site: str, clock: int, n: int) -> bool:
    """Whether the step `site` with `every: n` runs at `clock` (see the module docstring);
    the last clock it ran at is a counter of the node's, so a resume knows it."""
    if clock % n or counters.get(site) == clock:
        return False
    counters[site] = clock
    return True
