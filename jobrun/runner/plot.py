"""`jobrun plot`: the logged values of one or more runs against steps or epochs, as a PNG.

One panel per metric (a name a `log` op logged with a number, or an epoch task's numeric
output; `task.name` for each task when two give the name, as on the epoch line), one
line per run. Against the global step (`--x step`; `auto`, the default, when
the run took optimizer steps) a value sits at the `step` metrics.jsonl records with it and
an epoch output at the step its epoch ended. Against epochs (`--x epoch`; `auto` for a run
that takes no step) a value logged once an epoch sits at that epoch; one logged several
times in an epoch is spread evenly over the epoch, so that epoch E's points lie in
(E-1, E]. matplotlib is an optional extra: `pip install "jobrun[plot]"`.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from jobrun import safefs
from jobrun.errors import UsageError, did_you_mean
from jobrun.runner.display import shared_names, task_label
from jobrun.runner.rundir import RunDir, metrics_records

MAX_METRICS_BYTES = 1 << 30


class Series(dict[str, list[tuple[float, float]]]):
    """metric -> [(x, value)]; `axis` says what x is: "step" or "epoch"."""

    axis = "epoch"


def series(run: RunDir, x: str = "auto") -> Series:
    """Every numeric value the run logged, placed on the step axis or the epoch axis
    (``x``: "step", "epoch", or "auto": steps when the run took optimizer steps)."""
    try:
        data = safefs.read_bounded(run.metrics_file, MAX_METRICS_BYTES)
    except FileNotFoundError:
        return Series()
    except OSError as e:
        raise UsageError(f"cannot read {run.metrics_file}: {e.strerror or e}") from None
    # Keyed by (task, name, epoch): two tasks' same name are two lines (task_label).
    per_epoch: dict[tuple[str | None, str, int], list[float]] = defaultdict(list)
    steps: dict[tuple[str | None, str, int], list[int]] = defaultdict(list)  # the global step of each value
    ended: dict[int, int] = {}  # epoch -> the global step it ended at
    outputs: dict[tuple[str | None, str, int], float] = {}
    for _, record in metrics_records(run.metrics_file, data):
        epoch = record.epoch
        if epoch is None:
            continue
        step = record.step
        if record.event == "epoch":
            if step is not None:
                ended[epoch] = step
            for task, given in record.outputs.items():
                for name, value in given.items():
                    if _number(value):
                        outputs[(task, name, epoch)] = float(value)
        elif record.group == "epoch":
            for name, value in record.values.items():
                if _number(value):
                    per_epoch[(record.task, name, epoch)].append(float(value))
                    steps[(record.task, name, epoch)].append(step if step is not None else -1)
    # An epoch task's output that the epoch did not also log is a point at the epoch's end:
    # its record's step, or (a run written before epoch records had one) the epoch's last
    # logged step.
    logged_last: dict[int, int] = {}
    for (_, _, epoch), at in steps.items():
        logged_last[epoch] = max([logged_last.get(epoch, -1), *at])
    for key, value in outputs.items():
        if key not in per_epoch:
            per_epoch[key] = [value]
            steps[key] = [ended.get(key[2], logged_last.get(key[2], -1))]
    out = Series()
    by_step = x == "step" or (x == "auto" and any(s > 0 for s in ended.values())
                              and all(s >= 0 for v in steps.values() for s in v))
    if by_step:
        out.axis = "step"
    shared = shared_names((task, name) for task, name, _ in per_epoch)
    for (task, name, epoch), values in sorted(per_epoch.items(), key=lambda item: item[0][2]):
        label = task_label(task, name, shared)
        if by_step:  # a value without a step (an older run's) has no place on this axis
            points = [(float(s), v) for s, v in zip(steps[(task, name, epoch)], values) if s >= 0]
            if points:
                out.setdefault(label, []).extend(points)
            continue
        n = len(values)
        out.setdefault(label, []).extend((epoch - 1 + (k + 1) / n, v) for k, v in enumerate(values))
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def plot(run_dirs: list[str], output: str | None, metrics: tuple[str, ...], x: str = "auto") -> Path:
    runs = [RunDir(Path(d)) for d in run_dirs] if run_dirs else [RunDir.latest()]
    for run in runs:
        run.info()  # a clear message for what is not a run directory
    data = {run: series(run, x) for run in runs}
    found = sorted({name for s in data.values() for name in s})
    if not found:
        raise UsageError(f"{', '.join(str(r.path) for r in runs)}: no values logged in an epoch yet",
                         hint="a `log: {in: [loss]}` step in an epoch task logs them"
                         + ("; epoch outputs alone have no steps: --x epoch" if x == "step" else ""))
    for name in metrics:
        if name not in found:
            tasks = [f for f in found if f.endswith(f".{name}")]  # task_label's: two tasks give it
            raise UsageError(f"no metric {name!r} was logged", hint=f"each task gives its own: {', '.join(tasks)}"
                             if tasks else did_you_mean(name, found) or f"metrics: {', '.join(found)}")
    names = list(metrics) or found
    out = Path(output) if output else (runs[0].path / "metrics.png" if len(runs) == 1 else Path("metrics.png"))
    if out.suffix.lower() != ".png":
        raise UsageError(f"-o {out}: jobrun plot writes PNG files", hint="give -o FILE.png")
    if not out.parent.is_dir():
        raise UsageError(f"cannot write {out}: directory {out.parent} does not exist",
                         hint="create it first, or give another -o")
    _draw(data, names, out)
    return out


def _draw(data: dict[RunDir, Series], names: list[str], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("jobrun plot needs matplotlib, which is not installed",
                         hint='install the extra: pip install "jobrun[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Metric names and run directories are the user's text, not mathtext (`$\alpha$`
    # or `\undefinedmacro` would be parsed, and fail).
    with matplotlib.rc_context({"text.parse_math": False}):
        _panels(plt, data, names, out)


def _panels(plt: Any, data: dict[RunDir, Series], names: list[str], out: Path) -> None:
    cols = min(2, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for run, s in data.items():
            points = s.get(name)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3,
                        label=_label(run, data))
        ax.set_title(name)
        ax.set_xlabel("step" if all(s.axis == "step" for s in data.values()) else "epoch")
        ax.grid(alpha=0.3)
        if len(data) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=100)  # to memory: matplotlib opens a path itself
    finally:
        plt.close(fig)
    try:
        safefs.write_atomic(out, png.getvalue())
    except safefs.UnsafeFile as e:
        raise UsageError(f"refusing to write {out}: {e.strerror}", hint="remove it, or give another -o") from None
    except OSError as e:
        raise UsageError(f"cannot write {out}: {e.strerror or e}",
                         hint="check that its directory is writable and has space") from None


def _label(run: RunDir, data: dict[RunDir, Any]) -> str:
    names = [r.path.name for r in data]
    return run.path.name if names.count(run.path.name) == 1 else str(run.path)
