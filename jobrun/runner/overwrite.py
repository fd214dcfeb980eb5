"""`train --overwrite`: delete what the old run wrote, and nothing else.

What jobrun wrote is what its own records say: the run's manifest of its files
(:data:`RUN_SHAPE`: run.json, plan.yaml, metrics.jsonl, console.log, metrics.png,
tensorboard/'s event files, --profile's files, metrics.csv and trackers.json, and what
`save` and `export` ops recorded in
:data:`jobrun.safedel.WRITTEN_FILE`), and the checkpoint epochs of the old plan's nodes,
each rank directory by its manifest (:func:`jobrun.store.files.checkpoint_dir_shape`).
Everything goes through :func:`jobrun.safedel.remove_in`: no link is followed, nothing
outside the run's or the checkpoint directory's tree is touched, and what the user added
stays (stderr says what).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jobrun import safedel
from jobrun.errors import JobrunError, UsageError
from jobrun.runner.profile import PROFILE_JSON, PROFILE_TEXT, TRACE_DIR
from jobrun.runner.rundir import (
    CONSOLE_FILE,
    LOCK_FILE,
    METRICS_FILE,
    PLAN_FILE,
    PLOT_FILE,
    RUN_FILE,
    RunDir,
    _same_file,
    _write_error,
)
from jobrun.runner.trackers import CSV_FILE, IDS_FILE

if TYPE_CHECKING:
    from jobrun.plans import ir

# The run's manifest of its own files: what jobrun writes in a run directory (the lock
# stays: the new run holds it). A half-written file under write_atomic's temporary name
# is jobrun's too; tensorboard/ holds the event files torch's SummaryWriter writes.
# --profile's table and trace, the csv logger's rows and the trackers' ids are jobrun's
# too (the trackers' own stores, mlflow.db and wandb/, are theirs: a new run joins them).
_OWN_FILES = "|".join(map(re.escape, (RUN_FILE, PLAN_FILE, METRICS_FILE, CONSOLE_FILE, PLOT_FILE,
                                      safedel.WRITTEN_FILE, PROFILE_TEXT, PROFILE_JSON, CSV_FILE, IDS_FILE)))
RUN_SHAPE = safedel.Shape(
    files=re.compile(safedel.tmp_name_of(_OWN_FILES)),
    dirs=((re.compile("tensorboard"), safedel.Shape(files=re.compile(r"events\.out\.tfevents\..+"))),
          (re.compile(re.escape(TRACE_DIR)), safedel.Shape(files=re.compile(r".+\.pt\.trace\.json")))),
)


def clear(run: RunDir, keep: Path | None = None) -> list[str]:
    """Delete what the run in ``run`` wrote: its own files (:data:`RUN_SHAPE`, and those
    its ops recorded) and its plan's checkpoint epochs, where the plan put them. ``keep``:
    a file never deleted (the plan being trained, when it lies here). What else is there
    stays, and is said on stderr; the list of it is returned."""
    plan = old_plan(run)
    kept: list[str] = []
    try:
        if plan is not None and plan.checkpoint is not None:
            kept += _clear_checkpoints(run.path, plan)
        safedel.remove_recorded(run.path, keep)
        names = [e.name for e in os.scandir(run.path) if keep is None or not _same_file(run.path / e.name, keep)]
        top = _checkpoints_top(plan)
        kept += [k for k in safedel.remove_in(run.path, RUN_SHAPE, names) if k.rstrip("/") not in (LOCK_FILE, top)]
    except OSError as e:
        raise _write_error(Path(e.filename or run.path), e) from None
    if kept:
        print(f"note: train --overwrite kept what jobrun did not write in {run.path}: "
              f"{safedel.say_kept(kept)}", file=sys.stderr, flush=True)
    return kept


def old_plan(run: RunDir) -> ir.Plan | None:
    """The plan of the run in ``run``'s directory (None: it holds no jobrun run). A run
    whose plan does not load is refused: without it, which checkpoints are the run's and
    where is unknown, and guessing by names is what deleted the user's exp.1/ once."""
    if not _is_run(run):
        return None
    try:
        return RunDir(run.path).plan()
    except JobrunError as e:
        raise UsageError(
            f"--overwrite cannot tell which checkpoints the run in {run.path} wrote: its plan "
            f"does not load ({e.message})",
            hint="delete the old run (and its checkpoint directory) yourself, or choose another --run-dir",
        ) from None


def _is_run(run: RunDir) -> bool:
    try:
        RunDir(run.path).info()
    except UsageError:
        return False
    return True


def _checkpoints_top(plan: ir.Plan | None) -> str | None:
    """The run directory's entry that holds a relative checkpoint.dir (None: none)."""
    if plan is None or plan.checkpoint is None:
        return None
    parts = [p for p in Path(plan.checkpoint.dir).expanduser().parts if p != "."]
    return parts[0] if parts and not Path(parts[0]).is_absolute() and ".." not in parts else None


def _clear_checkpoints(run_path: Path, plan: ir.Plan) -> list[str]:
    """Delete the old plan's epochs in its checkpoint directory; what stays there inside
    them (relative to the run directory when the checkpoints are under it)."""
    from jobrun.store.files import checkpoint_dir_shape

    assert plan.checkpoint is not None
    rel = Path(plan.checkpoint.dir).expanduser()
    # A path that leaves the run directory is the user's own, taken as written; only the
    # part below the run directory (which others may write into) is opened no-follow.
    outside = rel.is_absolute() or ".." in rel.parts
    root, below = (Path(os.path.normpath(run_path / rel)), Path()) if outside else (run_path, rel)
    try:
        fd = safedel.open_under(root, below)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise UsageError(
            f"the run's checkpoint directory {root / below} is reached through a symlink (or is "
            "not a directory), so --overwrite will not delete the checkpoints there",
            hint="delete them yourself, or set checkpoint.dir to the directory the link "
                 "points to (an absolute path)") from e
    try:
        shape = checkpoint_dir_shape(plan.nodes)
        kept = safedel.remove_in(fd, shape, [n for n in os.listdir(fd) if shape.subdir(n) is not None])
    finally:
        os.close(fd)
    return [f"{root}/{k}" if outside else f"{below}/{k}" for k in kept]
