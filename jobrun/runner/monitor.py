"""Watching an epoch-task output across epochs: `early_stop` and `checkpoint.best`.

Both follow Lightning's meaning (EarlyStopping, ModelCheckpoint's monitor/mode/save_top_k):

* early stopping: an epoch improves when its value is better than the best so far by
  more than ``min_delta``; the job stops after the epoch that makes ``patience`` epochs
  in a row without improvement, or at once when the value is not finite (NaN, inf).
* best checkpoints: each saved epoch records its value in its checkpoint's meta; the
  ``keep`` best ones are protected from pruning, and the best one is what
  ``export --best`` and ``resume --epoch best`` use.

The early-stopping state is saved in the checkpoint meta of every epoch (not as a blob),
so a resume from epoch E counts exactly as the run that went through E did. Nothing here
imports torch: ``jobrun ckpt list`` and ``export`` use it too.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobrun import hints, store
from jobrun.errors import RunError, UsageError, a_type
from jobrun.plans import ir

EARLY_STOP_META = "early_stop"  # the state after the epoch
BEST_META = "best"  # {"monitor", "mode", "value"}: the epoch's own value


def monitored(monitor: ir.Monitor, outputs: dict[str, dict[str, Any]], epoch: int,
              what: str) -> float | None:
    """The monitored output's value after `epoch`, as a float (NaN stays NaN); None when
    the output is null: not measured this epoch (a validation every other epoch, as
    Lightning's `check_val_every_n_epoch`), which neither counts nor ranks."""
    name = monitor.name.name
    for task_outputs in outputs.values():
        if name in task_outputs:
            value = task_outputs[name]
            if value is None:
                return None
            number = _as_float(value)
            if number is None:
                raise RunError(
                    f"{what} monitors {name!r}, which holds {_kind(value)} after epoch {epoch}, not a number",
                    monitor.name.pos,
                    "monitor an output that is a number (or a one-element tensor), or null in an "
                    "epoch that does not measure it",
                )
            return number
    raise RunError(  # analyze checks the name: only a task that skipped its outputs gets here
        f"{what} monitors {name!r}, which no epoch task gave after epoch {epoch}", monitor.name.pos,
        f"make sure a task of `epoch` lists {name!r} in its `outputs`",
    )


def _as_float(value: Any) -> float | None:
    got = scalar(value)
    return float(got) if isinstance(got, bool | int | float) else None


def scalar(value: Any) -> Any:
    """An epoch output as a Python value: a one-element tensor's or a numpy scalar's
    (`train.step`'s mean loss stays a device tensor until read), None for a tensor of
    several values; anything else as it is."""
    item = getattr(value, "item", None)
    if not callable(item) or isinstance(value, bool | int | float | type):
        return value
    try:
        return item()
    except (ValueError, RuntimeError, TypeError):
        return None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{a_type(value)} of shape {list(shape)}"
    return a_type(value)


def _show(value: float) -> str:
    return f"{value:.6g}"


@dataclass
class EarlyStopping:
    """The state of `early_stop`: the best value, its epoch, the epochs since."""

    spec: ir.EarlyStop
    best: float | None = None
    best_epoch: int | None = None
    wait: int = 0
    bad_value: float | None = None  # a value that was not finite: the job stops at once
    bad_epoch: int | None = None

    def update(self, value: float | None, epoch: int) -> None:
        """Account for the value of `epoch` (once per epoch; None: not measured, not counted)."""
        if value is None:
            return
        if not math.isfinite(value):
            self.bad_value, self.bad_epoch = value, epoch
        elif self.spec.monitor.better(value, self.best, self.spec.min_delta):
            self.best, self.best_epoch, self.wait = value, epoch, 0
        else:
            self.wait += 1

    def reason(self, epoch: int | None = None) -> str | None:
        """Why the job stops now (after `epoch`), or None. Lightning checks `wait >=
        patience` only after an epoch without improvement (so patience 0 and 1 both stop
        at the first). Epochs that did not measure the value are named apart."""
        name = self.spec.monitor.name.name
        if self.bad_value is not None:
            best = f" (the best was {_show(self.best)} at epoch {self.best_epoch})" if self.best is not None else ""
            return f"{name} is {self.bad_value} after epoch {self.bad_epoch}, not a finite number{best}"
        if self.wait > 0 and self.wait >= self.spec.patience:
            best = f"{_show(self.best or 0.0)} (epoch {self.best_epoch})"
            better = (f"no better {name} than {best}" if not self.spec.min_delta else
                      f"no {name} better than {best} by more than {_show(self.spec.min_delta)}")
            since = epoch - self.best_epoch if epoch is not None and self.best_epoch is not None else 0
            counted = f"{self.wait} epoch{'s' * (self.wait != 1)}"
            if since > self.wait:  # epochs with a null value between them
                return f"{better} in the {counted} that measured it (of {since} since)"
            return f"{better} for {counted}"
        return None

    def state(self) -> dict[str, Any]:
        """What the checkpoint meta keeps (JSON: non-finite values as text)."""
        return {
            "monitor": self.spec.monitor.name.name, "mode": self.spec.monitor.mode,
            "min_delta": self.spec.min_delta, "best": self.best, "best_epoch": self.best_epoch,
            "wait": self.wait, "bad_value": None if self.bad_value is None else repr(self.bad_value),
            "bad_epoch": self.bad_epoch,
        }

    @classmethod
    def restored(cls, spec: ir.EarlyStop, state: Any) -> tuple[EarlyStopping, str | None]:
        """The state saved in a checkpoint's meta, and a note when it cannot be used: a
        checkpoint without one (epoch 0, or the run had no early_stop), or one that
        watched another output, mode or min_delta (a resume changed the plan)."""
        fresh = cls(spec)
        if not isinstance(state, dict):
            return fresh, None
        same = (state.get("monitor"), state.get("mode"), state.get("min_delta")) == (
            spec.monitor.name.name, spec.monitor.mode, spec.min_delta)
        if not same:
            return fresh, (f"early_stop watched {state.get('monitor')!r} ({state.get('mode')}, min_delta "
                           f"{state.get('min_delta')}) in the checkpoint; it starts counting again")
        try:
            best = state["best"]
            restored = cls(
                spec, None if best is None else float(best), _int_or_none(state["best_epoch"]),
                int(state["wait"]), None if state.get("bad_value") is None else float(state["bad_value"]),
                _int_or_none(state.get("bad_epoch")),
            )
        except (KeyError, TypeError, ValueError):
            return fresh, "the checkpoint's early_stop state is damaged; it starts counting again"
        return restored, None


class Watch:
    """What a job watches across epochs: `early_stop` and `checkpoint.best` (the runner's
    seam: a few calls per epoch)."""

    def __init__(self, plan: ir.Plan):
        self.early = EarlyStopping(plan.early_stop) if plan.early_stop is not None else None
        self.best = plan.checkpoint.best if plan.checkpoint is not None else None

    def after_epoch(self, outputs: dict[str, dict[str, Any]], epoch: int) -> str | None:
        """Count this epoch's value (once per epoch); why the job stops early now, or None."""
        if self.early is None:
            return None
        self.early.update(monitored(self.early.spec.monitor, outputs, epoch, "early_stop"), epoch)
        return self.early.reason(epoch)

    def meta(self, outputs: dict[str, dict[str, Any]] | None, epoch: int) -> dict[str, Any]:
        """What the checkpoint of `epoch` keeps in its meta."""
        meta: dict[str, Any] = {}
        if self.early is not None:
            meta[EARLY_STOP_META] = self.early.state()
        if self.best is not None and outputs:
            meta[BEST_META] = best_meta(self.best, outputs, epoch)
        return meta

    def restore(self, meta: dict[str, Any], epoch: int) -> tuple[str | None, str | None]:
        """Take the state of the resumed checkpoint of `epoch`: (why the job stops
        already, a note when the saved state cannot be used)."""
        if self.early is None:
            return None, None
        self.early, note = EarlyStopping.restored(self.early.spec, meta.get(EARLY_STOP_META))
        return self.early.reason(epoch), note

    def protected(self, ckpt_dir: Path, nodes: list[str], complete: Collection[int] = ()) -> list[int]:
        """The `keep` best epochs in `ckpt_dir` by checkpoint.best, which pruning must keep
        (``complete``: as for store.prunable)."""
        if self.best is None:
            return []
        ranked = ranked_epochs(store.list_checkpoints(ckpt_dir), nodes, self.best.monitor, complete)
        return [epoch for epoch, _ in ranked[: self.best.keep]]


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


# -- best checkpoints ----------------------------------------------------------------------


def best_meta(best: ir.Best, outputs: dict[str, dict[str, Any]], epoch: int) -> dict[str, Any]:
    """The meta entry of a saved epoch: its monitored value (None when not finite, or not
    measured this epoch)."""
    value = monitored(best.monitor, outputs, epoch, "checkpoint.best")
    return {"monitor": best.monitor.name.name, "mode": best.monitor.mode,
            "value": value if value is not None and math.isfinite(value) else None}


def ranked_epochs(infos: list[Any], nodes: list[str], monitor: ir.Monitor,
                  complete: Collection[int] = ()) -> list[tuple[int, float]]:
    """(epoch, value) of the complete epochs that recorded a value of `monitor`, best
    first (the earlier epoch first among equals). `infos`: store.list_checkpoints();
    ``complete``: epochs known complete whatever `infos` says (as for store.prunable)."""
    found = []
    for info in infos:
        if not nodes or not all(n in info.nodes and (info.epoch in complete or info.nodes[n].ok)
                                for n in nodes):
            continue
        meta = info.nodes[nodes[0]].meta or {}
        value = epoch_value(meta, monitor)
        if value is not None:
            found.append((info.epoch, value))
    sign = 1.0 if monitor.mode == "min" else -1.0
    return sorted(found, key=lambda ev: (sign * ev[1], ev[0]))


def epoch_value(meta: dict[str, Any], monitor: ir.Monitor) -> float | None:
    """The value a checkpoint's meta recorded for `monitor` (None: none, or another one)."""
    entry = meta.get(BEST_META)
    if not isinstance(entry, dict) or entry.get("monitor") != monitor.name.name:
        return None
    value = entry.get("value")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _listed(instead: str) -> str:
    return f"{instead} (`{hints.command('ckpt list')}` shows the epochs)"


def best_epoch(infos: list[Any], nodes: list[str], plan: ir.Plan, where: str,
               complete: Collection[int] = (), instead: str = "give --epoch E") -> int:
    """The best epoch of a run (`--epoch best`, `checkpoint.load`'s `epoch: best`), or a
    UsageError saying why there is none and, ``instead``, what else to give (``complete``:
    as for ranked_epochs)."""
    best = plan.checkpoint.best if plan.checkpoint is not None else None
    if best is None:
        raise UsageError(
            f"the plan of {where} has no `checkpoint.best`, so no epoch is the best one",
            hint=f"{_listed(instead)}, or add checkpoint: {{best: {{monitor: val_loss, mode: min}}}} to the "
                 "plan for the next run",
        )
    ranked = ranked_epochs(infos, nodes, best.monitor, complete)
    if not ranked:
        raise UsageError(
            f"no complete checkpoint of {where} recorded a value of {best.monitor.name.name!r} "
            "(null or not finite in every saved epoch)",
            hint=_listed(instead),
        )
    return ranked[0][0]
