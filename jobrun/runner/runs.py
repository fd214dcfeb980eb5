"""Which run directory a command means: a new one per `train`, the latest for the others,
and `jobrun runs`, the list of them.

    runs/<job>/<N>/   the N-th run of a job, N = 1 + the highest there (Lightning's
                      version_N): each `train` without --run-dir makes a new one, so
                      re-running a plan with other overrides never meets a finished run
    latest            the run under ./runs started (or resumed) last, by run.json's
                      `started`: every command that takes a run directory defaults to it

Numbers rather than dates: `runs/mlp/3` is short to type and to say, sorts as it was
made, and two runs in one second cannot collide. A run directory of the old layout
(runs/<job> itself a run, or any --run-dir under ./runs) is found and listed as well;
when runs/<job> is such a run, new runs go next to it as runs/<job>-<N>. Nothing here
imports torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jobrun import safefs
from jobrun.errors import JobrunError, UsageError
from jobrun.runner.locks import holder
from jobrun.runner.rundir import LOCK_FILE, RUN_FILE, RunDir

ROOT = Path("runs")
MAX_METRICS_BYTES = 1 << 30


def new_run_path(job: str, root: Path = ROOT) -> Path:
    """Where the next run of ``job`` goes (not created yet): runs/<job>/<N>."""
    home = root / job
    parent, prefix = (root, f"{job}-") if (home / RUN_FILE).exists() else (home, "")
    pattern = re.compile(re.escape(prefix) + r"(\d{1,9})")
    taken = [int(m.group(1)) for name in _names(parent) if (m := pattern.fullmatch(name))]
    return parent / f"{prefix}{max(taken, default=0) + 1}"


def _names(path: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(path)]
    except OSError:
        return []


def find_runs(root: Path = ROOT, damaged: bool = False) -> list[RunDir]:
    """Every run directory under ``root`` (one or two levels down), or ``root`` itself when
    it is one, oldest start first; ``damaged``: also those whose run.json is there but
    cannot be read (first)."""
    found: list[tuple[float, str, RunDir]] = []
    for path in _candidates(root):
        run = RunDir(path)
        try:
            started = float(run.info().started or 0)
        except (JobrunError, TypeError, ValueError):
            if not (damaged and _may_hold_run(path)):
                continue
            started = -1.0
        found.append((started, str(path), run))
    return [run for _, _, run in sorted(found, key=lambda t: (t[0], t[1]))]


def _may_hold_run(path: Path) -> bool:
    """Whether ``path`` holds a run.json, or one it cannot tell of (a directory made
    unreadable: listed as damaged, not a traceback from pathlib)."""
    try:
        return stat.S_ISREG(os.stat(path / RUN_FILE).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True


def _candidates(root: Path) -> list[Path]:
    """``root`` when it is a run (`jobrun runs runs/mnist`), else the directories one or
    two levels under it (runs/<job>/<N>, and runs/<name> of `--run-dir runs/<name>`)."""
    if _may_hold_run(root):
        return [root]
    out = []
    for first in sorted(_names(root)):
        d = root / first
        out += [p for p in [d, *(d / n for n in sorted(_names(d)))] if p.is_dir() and not p.is_symlink()]
    return out


def latest(root: Path = ROOT) -> RunDir:
    """The run started (or resumed) last under ``root``."""
    runs = find_runs(root)
    if not runs:
        raise UsageError(f"no runs under {root}/", hint="start one with `jobrun train PLAN`, "
                         f"or give the run directory (e.g. `{_command()} path/to/run`)")
    return runs[-1]


def _command() -> str:
    """The command running (`jobrun ckpt list`), for a hint that shows how to call it."""
    import click

    ctx = click.get_current_context(silent=True)
    words = ctx.command_path.split()[1:] if ctx is not None else []
    return " ".join(["jobrun", *(words or ["resume"])])


def pick(run_dir: str | None, say: bool = True) -> Path:
    """The run directory a command works on: the one given, else the latest (named on
    stderr, so that the user sees which one it picked)."""
    if run_dir is not None:
        return Path(run_dir)
    path = latest().path
    if say:
        import click

        click.echo(f"run {path} (the latest; give a run directory to pick another)", err=True)
    return path


# -- jobrun runs --------------------------------------------------------------------------


@dataclass
class Summary:
    path: str
    job: str
    status: str
    epochs: int | None
    monitor: str | None
    best: float | None
    best_epoch: int | None
    started: float | None
    overrides: list[str]
    # The newest complete checkpoint (what `jobrun resume` goes on from) of a run that
    # failed, died or was interrupted, where it may be older than its last epoch.
    last_checkpoint: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(run: RunDir) -> Summary:
    try:
        info = run.info()
    except (JobrunError, TypeError, ValueError):  # listed, not hidden: `jobrun resume` says what is wrong
        return Summary(str(run.path), "?", "damaged", None, None, None, None, None, [])
    monitor, mode = _monitor(run)
    status, epochs = str(info.status or "?"), info.last_epoch
    if holder(run.path / LOCK_FILE) is not None:
        status = "running"  # a process holds the run (a resume still in init says so too)
    elif status == "running" and not run.several_hosts():
        status = "died"  # no process holds it, nothing recorded how it ended: a kill -9, the OOM killer
    records = _epoch_records(run) if monitor is not None or status in ("running", "died") else []
    if status in ("running", "died"):  # run.json's last_epoch is written when a run ends
        epochs = max((r["epoch"] for r in records), default=epochs)
    best = best_epoch = None
    if monitor is not None:
        for epoch, value in _values(records, monitor):
            if best is None or (value < best if mode == "min" else value > best):
                best, best_epoch = value, epoch
    # run.json is checked by its schema (records_schema.RUN_INFO): the fields have their types.
    return Summary(str(run.path), str(info.job), status, epochs, monitor, best, best_epoch,
                   None if info.started is None else float(info.started), list(info.sets or []),
                   _last_checkpoint(run) if status in ("failed", "died", "interrupted") else None)


def _last_checkpoint(run: RunDir) -> int | None:
    """The newest complete checkpoint epoch, as `jobrun export` picks it by default
    (None: none, or the plan writes none or cannot be compiled: a listing never fails)."""
    from jobrun import store
    from jobrun.runner.inspect import latest_complete

    try:
        ckpt_dir = run.checkpoints
        if ckpt_dir is None or not ckpt_dir.is_dir():
            return None
        infos = store.list_checkpoints(ckpt_dir)
        return latest_complete(ckpt_dir, list(run.plan().nodes), run.several_hosts(), infos)
    except (JobrunError, OSError):
        return None


def _monitor(run: RunDir) -> tuple[str | None, str]:
    """The output the plan watches (checkpoint.best, else early_stop), and its mode; the
    stored plan is read as YAML, not compiled (a listing must not fail on one plan)."""
    try:
        tree = yaml.safe_load(safefs.read_bounded(run.plan_file, 1 << 24))
    except (OSError, yaml.YAMLError):
        return None, "min"
    if not isinstance(tree, dict):
        return None, "min"
    ck = tree.get("checkpoint")
    for spec in ((ck or {}).get("best") if isinstance(ck, dict) else None, tree.get("early_stop")):
        if isinstance(spec, dict) and isinstance(spec.get("monitor"), str):
            return spec["monitor"], "max" if spec.get("mode") == "max" else "min"
    return None, "min"


def _epoch_records(run: RunDir) -> list[dict[str, Any]]:
    """The epoch records of the run's metrics.jsonl (one per epoch that ran to its end)."""
    try:
        data = safefs.read_bounded(run.metrics_file, MAX_METRICS_BYTES)
    except OSError:
        return []
    out = []
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "epoch" and isinstance(record.get("epoch"), int):
            out.append(record)
    return out


def _values(records: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    """(epoch, value) of an epoch-task output, from the run's epoch records."""
    out = []
    for record in records:
        for outputs in (record.get("outputs") or {}).values():
            value = outputs.get(name) if isinstance(outputs, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                out.append((record["epoch"], float(value)))
    return out


def runs_text(as_json: bool, root: Path = ROOT) -> str:
    """`jobrun runs [DIR]`: the runs under ``root`` (./runs by default), or ``root`` itself."""
    summaries = [summarize(run) for run in find_runs(root, damaged=True)]
    if as_json:
        return json.dumps([s.to_json() for s in summaries], indent=2)
    if not summaries:
        return (f"no runs under {root}/ (start one with `jobrun train PLAN`; "
                "list those trained with --run-dir elsewhere with `jobrun runs DIR`)")
    rows = [("RUN", "JOB", "STATUS", "EPOCHS", "BEST", "STARTED", "OVERRIDES")]
    for s in summaries:
        best = "-" if s.best is None else f"{s.monitor}={s.best:.4g} (epoch {s.best_epoch})"
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.started)) if s.started else "-"
        epochs = "-" if s.epochs is None else str(s.epochs)
        if s.last_checkpoint is not None and s.last_checkpoint != s.epochs:
            epochs += f" (ckpt {s.last_checkpoint})"  # what a resume goes on from
        rows.append((s.path, s.job, s.status, epochs, best, started, " ".join(s.overrides) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]
                     for r in rows)
