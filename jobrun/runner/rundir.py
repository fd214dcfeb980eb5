"""The run directory: the resolved plan, the run's facts and its lock (its metrics and
TensorBoard scalars: :mod:`jobrun.runner.records`).

    runs/<job>/
      run.json        where the plan came from, plan_dir, replicas, device, status; its
                      presence (a JSON object naming the job) marks a jobrun run directory
      plan.yaml       the plan after --set (vars are substituted again on resume)
      metrics.jsonl   one JSON object per log line / checkpoint event
      console.log     what the run printed, and torch's own log lines (the launcher's)
      checkpoints/    <node>.<epoch>/rank-<r>/...
      .lock           held by the running job (flock), so two runners cannot share it

jobrun writes into a directory only when it is new, empty, or a jobrun run directory, and
never trains over one that holds checkpoints. Every file it writes here is opened through
:mod:`jobrun.safefs`, so a symlink or FIFO planted in the directory is an error, not a
write through it. `train --overwrite` deletes what the run wrote and nothing else
(:mod:`jobrun.runner.overwrite`); what the user added stays.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobrun import hints, records_schema, safedel, safefs
from jobrun.errors import JobrunError, UsageError
from jobrun.runner.locks import hold_dir_lock, hold_lock, holder

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from jobrun.plans import ir
    from jobrun.records_schema import MetricsRecord, RunInfo

RUN_FILE = "run.json"
PLAN_FILE = "plan.yaml"
METRICS_FILE = "metrics.jsonl"
CONSOLE_FILE = "console.log"
LOCK_FILE = ".lock"
PLOT_FILE = "metrics.png"  # `jobrun plot`'s default output
MAX_INFO_BYTES = 1 << 20
MAX_ERROR_CHARS = 1 << 14

_METRICS_SHAPE = safedel.Shape(files=re.compile(re.escape(METRICS_FILE)))  # a new run's, emptied

# A checkpoint epoch directory (`<node>.<epoch>`, see the store) and its rank folders.
_EPOCH_DIR = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.\d+")


class RunDir:
    """One run directory. ``plan``: the compiled plan when the caller has it (`train`);
    otherwise :meth:`plan` compiles the run's own, once."""

    def __init__(self, path: Path, plan: ir.Plan | None = None):
        self.path = path
        self._plan = plan
        self._info: RunInfo | None = None

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @classmethod
    def latest(cls, root: Path = Path("runs")) -> RunDir:
        """The run started (or resumed) last under ./runs (:mod:`jobrun.runner.runs`)."""
        from jobrun.runner.runs import latest

        return latest(root)

    # -- paths -------------------------------------------------------------------------
    @property
    def info_file(self) -> Path:
        return self.path / RUN_FILE

    @property
    def plan_file(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def console_file(self) -> Path:
        return self.path / CONSOLE_FILE

    @property
    def checkpoints(self) -> Path | None:
        """Where the plan's checkpoints go (None: the plan writes none). A relative
        `checkpoint.dir` is under the run directory; an absolute one is the user's."""
        plan = self.plan()
        if plan.checkpoint is None:
            return None
        p = Path(plan.checkpoint.dir).expanduser()
        return p if p.is_absolute() else self.path / p

    def under(self, path: str) -> Path:
        """A path a plan gives, relative to this run directory unless absolute."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.path / p

    # -- run.json ----------------------------------------------------------------------
    def several_hosts(self) -> bool:
        """Whether the run's ranks ran on several hosts (rank 0's run.json records how many;
        another host's copy says it is one): without a shared disk, each host's directory
        holds only its own ranks' checkpoint files."""
        info = self.info()
        return "host_copy_of" in info or (info.hosts or 1) > 1

    def info(self) -> RunInfo:
        """run.json, checked against its schema (records_schema.RUN_INFO)."""
        if self._info is None:
            self._info = self._read_info()
        return self._info

    def _read_info(self) -> RunInfo:
        try:
            data = safefs.read_bounded(self.info_file, MAX_INFO_BYTES)
        except FileNotFoundError:
            if not self.path.is_dir():
                raise UsageError(f"there is no run in {self.path}: the directory does not exist",
                                 hint="start one with `jobrun train PLAN --run-dir DIR`") from None
            raise UsageError(
                f"{self.path} is not a jobrun run directory (no {RUN_FILE})",
                hint="give the directory `jobrun train` created (runs/<job>/<N> by default)",
            ) from None
        except OSError as e:
            if self.path.is_file():  # `jobrun resume plan.yaml`
                plan = f"; to train this plan: `{hints.train_again(str(self.path), ())}`" \
                    if self.path.suffix in (".yaml", ".yml") else ""
                raise UsageError(f"{self.path} is a file, not a run directory",
                                 hint=f"give the directory `jobrun train` created (runs/<job>/<N> by default){plan}",
                                 ) from None
            raise UsageError(f"cannot read {self.info_file}: {e.strerror or e}") from None
        if len(data) > MAX_INFO_BYTES:
            raise UsageError(f"{self.info_file} is over {MAX_INFO_BYTES >> 20} MiB: it is no jobrun run record",
                             hint="give the directory `jobrun train` created")

        def error(message: str) -> UsageError:
            return UsageError(message, hint="it is jobrun's record of the run (give the directory "
                              "`jobrun train` created); restore run.json or start a new run")

        return records_schema.run_info(data, str(self.info_file), error)

    def write_info(self, info: dict[str, Any]) -> None:
        text = json.dumps(info, indent=2, sort_keys=True) + "\n"
        self._write(self.info_file, text.encode())
        self._info = None  # read back (and checked) when next needed

    def update_info(self, **changes: Any) -> None:
        self.write_info({**self.info().record, **changes})

    def record_end(self, status: str, error: Any = None, last_epoch: int | None = None,
                   keep_ended: bool = False) -> None:
        """Say in run.json how the run ended: finished, interrupted or failed (with the
        error and its plan position). A run.json that cannot be written (a full disk)
        costs a warning on stderr, never the job. ``keep_ended``: leave what a worker
        recorded already (the launcher knows less of a failure than the rank that had it)."""
        self._info = None
        if keep_ended:
            try:
                if self.info().status != "running":
                    return
            except JobrunError:
                pass
        facts: dict[str, Any] = {"status": status, "ended": time.time(), "error": None, "error_at": None}
        if last_epoch is not None:
            facts["last_epoch"] = last_epoch
        if error is not None:
            facts["error"] = error.message[:MAX_ERROR_CHARS]  # run.json stays under MAX_INFO_BYTES
            facts["error_at"] = str(error.pos) if error.pos else None
        try:
            self.update_info(**facts)
        except JobrunError as e:
            print(f"warning: the run's status ({status}) was not recorded: {e.message}",
                  file=sys.stderr, flush=True)

    def record_restart(self, facts: dict[str, Any]) -> None:
        """Add a restart to run.json: which rank died, how, and the epoch the job went on
        from (rank 0 of the restarted ranks writes it; a full disk costs a warning)."""
        self._info = None
        try:
            info = self.info()
            self.write_info({**info.record, "status": "running", "error": None, "error_at": None,
                             "restarts": [*(info.restarts or []), facts]})
        except JobrunError as e:
            print(f"warning: the restart was not recorded in {self.info_file}: {e.message}",
                  file=sys.stderr, flush=True)

    def _write(self, path: Path, data: bytes) -> None:
        try:
            safefs.write_atomic(path, data)
        except OSError as e:
            raise _write_error(path, e) from None

    # -- the plan ----------------------------------------------------------------------
    def plan(self) -> ir.Plan:
        """The plan this run uses: the user's file when unchanged (so that messages point
        at it), else the resolved copy stored here. Compiled once."""
        if self._plan is None:
            self._plan = self._compile()
        return self._plan

    def _compile(self) -> ir.Plan:
        from jobrun.plans.compile import compile_tree

        tree, name, sets = self._source()
        return compile_tree(tree, name, sets, run_dir=str(self.path.resolve()),
                            plan_dir=str(self.plan_dir))

    def _source(self) -> tuple[Any, str, list[str]]:
        """The run's plan tree as loaded, its file name, and the overrides to apply."""
        from jobrun.plans.load import load_file

        if self.source_changed():
            return load_file(self.plan_file, run_file=True), str(self.plan_file), []
        source = str(self.info().source)
        return load_file(source), source, list(self.info().sets or [])

    def source_changed(self) -> bool:
        """Whether the user's plan file is gone or differs from the one the run started
        with (the run then uses its stored copy, plan.yaml)."""
        import hashlib

        from jobrun.plans.load import MAX_FILE_BYTES

        info = self.info()
        if not info.source:
            return True
        try:
            # Bounded: a `source` naming a huge file is no plan (a plan is read whole).
            data = safefs.read_bounded(Path(info.source), MAX_FILE_BYTES, follow=True)
        except OSError:
            return True
        return len(data) > MAX_FILE_BYTES or hashlib.sha256(data).hexdigest() != info.plan_sha256

    def plan_text(self) -> str:
        """The run's plan copy (plan.yaml), read as a file of the run: regular, bounded."""
        from jobrun.plans.load import MAX_FILE_BYTES

        try:
            return safefs.read_bounded(self.plan_file, MAX_FILE_BYTES).decode(errors="replace")
        except OSError as e:
            raise UsageError(f"cannot read {self.plan_file}: {e.strerror or e}",
                             hint="it is jobrun's copy of the run's plan; restore it") from None

    def changed_plan(self, sets: Sequence[str]) -> tuple[ir.Plan, list[str], Any]:
        """The run's plan with more overrides (a resume that changes it): the plan, what
        changed (`key: old -> new`), and the tree to store as plan.yaml."""
        from jobrun.plans.compile import compile_tree
        from jobrun.plans.load import to_plain
        from jobrun.plans.overrides import apply_sets
        from jobrun.runner.planchanges import plan_changes

        tree, name, own = self._source()
        apply_sets(tree, own)
        before = to_plain(tree)
        apply_sets(tree, sets)
        after = to_plain(tree)
        dirs = {"run_dir": str(self.path.resolve()), "plan_dir": str(self.plan_dir)}
        plan = compile_tree(tree, name, (), **dirs)
        self._plan = plan
        was, _, _ = self._source()  # compiled as before, for the values the change gave
        compile_tree(was, name, own, **dirs)
        return plan, plan_changes(before, after, to_plain(was), to_plain(tree)), after

    @property
    def plan_dir(self) -> Path:
        return Path(self.info().plan_dir or self.path.resolve())

    # -- creating a run ----------------------------------------------------------------
    def check_can_train(self, checkpoint_dir: Path | None, overwrite: bool = False) -> None:
        """Refuse to start a run here unless the directory is new, empty, or a jobrun run
        directory without checkpoints (``overwrite``: with them; :meth:`clear` removes
        them). ``checkpoint_dir``: where the new plan writes its checkpoints, which must
        hold none either (it may lie outside the run directory)."""
        def hint_resume() -> str:  # made when it is said: it reads ./runs
            return (f"continue it with `{hints.command('resume', run=self.path)}`, replace it: add --overwrite "
                    "to this `jobrun train`, or choose another --run-dir")

        try:
            os.stat(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:  # a name too long, a component that is a file
            raise UsageError(f"--run-dir {self.path}: {e.strerror or e}", hint="choose another --run-dir") from None
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"--run-dir {self.path} is not a directory", hint="choose another --run-dir")
        if self.path.is_dir():
            is_run = self._is_run()
            held = self._held_checkpoints()
            if held and not (overwrite and is_run):
                if overwrite:
                    raise UsageError(
                        f"{self.path} holds checkpoints ({held}) but is not a jobrun run directory "
                        f"(its {RUN_FILE} is missing or damaged), so --overwrite will not delete it",
                        hint="remove it yourself, or choose another --run-dir")
                raise UsageError(f"run directory {self.path} already holds checkpoints ({held})",
                                 hint=hint_resume())
            if not is_run and any(p.name != LOCK_FILE for p in self.path.iterdir()):
                raise UsageError(
                    f"{self.path} is not empty and is not a jobrun run directory",
                    hint="jobrun only writes into a new or empty directory: choose another --run-dir",
                )
        if checkpoint_dir is not None:
            _check_checkpoint_dir(checkpoint_dir, outside=not _inside(checkpoint_dir, self.path))
        if checkpoint_dir is not None and not _inside(checkpoint_dir, self.path) \
                and (who := holder(checkpoint_dir / LOCK_FILE)):
            raise _checkpoints_busy(checkpoint_dir, who)  # before "holds checkpoints": the cause
        if checkpoint_dir is not None and not (overwrite and self._owns(checkpoint_dir)) \
                and _holds_checkpoints(checkpoint_dir, depth=0):
            theirs = not (self.path.is_dir() and self._owns(checkpoint_dir))  # another run's
            raise UsageError(f"checkpoint directory {checkpoint_dir} already holds checkpoints",
                             hint="they are another run's (or an older run's of this directory): set "
                                  "checkpoint.dir to another directory (--set checkpoint.dir=DIR)"
                             if theirs else hint_resume())

    def _owns(self, checkpoint_dir: Path) -> bool:
        """Whether ``checkpoint_dir`` is this (existing) run's own checkpoint directory."""
        from jobrun.runner.overwrite import old_plan

        plan = old_plan(self)  # refused when it does not load: its checkpoints are unknown
        old = RunDir(self.path, plan).checkpoints if plan is not None else None
        return old is not None and old.resolve() == checkpoint_dir.resolve()

    def clear(self, keep: Path | None = None) -> list[str]:
        """Delete what an existing run wrote (``train --overwrite``): see
        :func:`jobrun.runner.overwrite.clear`. What it kept, which stderr is told."""
        from jobrun.runner.overwrite import clear

        kept = clear(self, keep)
        self._info = None
        return kept

    def _is_run(self) -> bool:
        try:
            self.info()
        except UsageError:
            return False
        return True

    def _held_checkpoints(self) -> str | None:
        """The first checkpoint found anywhere in the run directory (a few levels down),
        whatever run.json says: a missing or damaged run.json must not hide them."""
        found = _holds_checkpoints(self.path, depth=3)
        return str(found.relative_to(self.path)) if found else None

    def create(self, new: bool = False) -> None:
        """``new``: the directory must not exist yet (a new numbered run, which two
        `train` started at once could both have picked)."""
        try:
            self.path.mkdir(parents=True, exist_ok=not new)
        except FileExistsError:
            if self.path.is_symlink():  # a link to nothing: mkdir finds the name taken
                raise UsageError(f"--run-dir {self.path} is a link to {os.readlink(self.path)}, which "
                                 "does not exist", hint="make its target, or choose another --run-dir") from None
            raise RunTaken(f"another `jobrun train` made {self.path} at the same moment",
                           hint="run the command again: it takes the next number") from None
        except OSError as e:
            raise _write_error(self.path, e) from None

    def write_plan(self, plan_text: str) -> None:
        self._write(self.plan_file, plan_text.encode())

    def start(self, plan_text: str, info: dict[str, Any]) -> None:
        """Write the plan copy and run.json of a new run; a new run's metrics start empty
        (the directory held a run without checkpoints: its metrics are jobrun's own).
        A plan trained from this directory's own plan.yaml is the copy: never written over."""
        if not _same_file(self.plan_file, Path(str(info.get("source", "")))):
            self.write_plan(plan_text)
        self.write_info(info)
        try:
            safefs.check_replaceable(self.metrics_file)
            safedel.remove_in(self.path, _METRICS_SHAPE, [METRICS_FILE])
        except OSError as e:
            raise _write_error(self.metrics_file, e) from None

    @contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive flock on <run_dir>/.lock while the block runs."""
        with hold_lock(self.path / LOCK_FILE, f"pid {os.getpid()}",
                       lambda who: UsageError(f"run directory {self.path} is in use by {who}",
                                                 hint="wait for that job to end, or use another run directory")):
            yield

    @contextmanager
    def lock_checkpoints(self, checkpoint_dir: Path | None) -> Iterator[None]:
        """An exclusive flock on <checkpoint_dir>/.lock while the block runs, so that two
        runs given one checkpoint.dir cannot write each other's epochs. A checkpoint
        directory inside this run directory is covered by the run's own lock."""
        if checkpoint_dir is None or _inside(checkpoint_dir, self.path):
            yield
            return
        _check_checkpoint_dir(checkpoint_dir, outside=True)  # a resume's, made read-only since
        me = f"run {self.path.resolve()} (pid {os.getpid()})"
        with hold_dir_lock(checkpoint_dir / LOCK_FILE, me, lambda who: _checkpoints_busy(checkpoint_dir, who)):
            yield

    def truncate_metrics(self, after_epoch: int) -> list[MetricsRecord]:
        """On resume from epoch E, drop what the interrupted run logged after E; the
        records kept."""
        lines = self.metrics_lines()
        if lines is None:
            return []
        kept = [(line, record) for line, record in lines  # the end phase runs again
                if record.group not in ("download", "exit") and (record.epoch or 0) <= after_epoch]
        self._write(self.metrics_file, "".join(line + "\n" for line, _ in kept).encode())
        return [record for _, record in kept]

    def metrics_lines(self) -> list[tuple[str, MetricsRecord]] | None:
        """metrics.jsonl's (line, record) pairs (None: there is no file); a UsageError
        naming a damaged line. A resume reads them before it changes anything: it must not
        remove checkpoints (`--epoch`) and then stop on the file."""
        path = self.metrics_file
        try:
            data = safefs.read_bounded(path, 1 << 40)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
        return list(metrics_records(path, data))


def _check_checkpoint_dir(checkpoint_dir: Path, outside: bool) -> None:
    """Refuse a checkpoint directory that cannot be one (a file, or under a file; one
    ``outside`` the run that cannot be written): the run trained to its end with every
    save failing, and said "last checkpoint epoch 0"."""
    for p in (checkpoint_dir, *checkpoint_dir.parents):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise UsageError(f"checkpoint directory {checkpoint_dir}: {e.strerror or e}",
                             hint="set checkpoint.dir to a directory (--set checkpoint.dir=DIR)") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"checkpoint directory {checkpoint_dir} cannot be made: {p} is a file",
                             hint="set checkpoint.dir to a directory (--set checkpoint.dir=DIR)")
        if outside and not os.access(p, os.W_OK | os.X_OK):
            why = "is on a read-only file system" if os.statvfs(p).f_flag & os.ST_RDONLY else "is not writable"
            raise UsageError(f"checkpoint directory {checkpoint_dir} cannot be written: {p} {why}",
                             hint="set checkpoint.dir to a directory you can write (--set checkpoint.dir=DIR)")
        return


def _checkpoints_busy(checkpoint_dir: Path, who: str) -> UsageError:
    return UsageError(f"checkpoint directory {checkpoint_dir} is in use by {who}",
                      hint="two runs cannot share a checkpoint directory: set checkpoint.dir to another "
                           "directory (--set checkpoint.dir=DIR), or wait for that run to end")


class RunTaken(UsageError):
    """A new numbered run's directory, made by another `train` since its number was picked."""


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def metrics_records(path: Path, data: bytes) -> Iterator[tuple[str, MetricsRecord]]:
    """(line, record) of each line of metrics.jsonl (``data``), checked against its
    schema (lines cut by a kill left out); a UsageError naming the file, the line and
    the field for any other that is no record."""
    for n, line in enumerate(data.decode(errors="replace").splitlines(), 1):
        try:
            record = records_schema.metrics_line(line, f"{path}:{n}")
        except records_schema.Invalid as e:
            raise UsageError(f"{e} (the run's metrics file is damaged)",
                             hint=f"repair or delete that line of {path}") from None
        if record is not None:
            yield line, record


def _holds_checkpoints(root: Path, depth: int) -> Path | None:
    """A `<node>.<epoch>/rank-<r>` checkpoint directory in ``root`` or up to ``depth``
    levels below it (symlinks are not followed)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return None
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if _EPOCH_DIR.fullmatch(entry.name) and _has_ranks(path):
            return path
        if depth > 0:
            found = _holds_checkpoints(path, depth - 1)
            if found:
                return found
    return None


def jobruns_own(run_dir: Path, checkpoint_dir: Path | None, target: Path) -> str | None:
    """Whether a file written at ``target`` would replace the run's own: its records
    (run.json, plan.yaml, metrics.jsonl...), which every command reads, or anything in its
    checkpoint directory (what it is: "is in the run's checkpoint directory ..."); None
    when not (a `save` or `export` path, `export -o`)."""
    t, run = Path(os.path.realpath(target)), Path(os.path.realpath(run_dir))
    if t.parent == run and t.name in (RUN_FILE, PLAN_FILE, METRICS_FILE, CONSOLE_FILE, LOCK_FILE,
                                      safedel.WRITTEN_FILE):
        return f"is the run's own {t.name}"
    if checkpoint_dir is not None:
        ckpt = Path(os.path.realpath(checkpoint_dir))
        first = t.relative_to(ckpt).parts[:1] if ckpt in t.parents else ()
        if first and (first[0] == LOCK_FILE or re.fullmatch(r".+\.\d+", first[0])):  # <node>.<epoch>
            return f"is in the run's checkpoint directory ({checkpoint_dir})"
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _has_ranks(path: Path) -> bool:
    try:
        return any(c.name.startswith("rank-") for c in os.scandir(path))
    except OSError:
        return False


def _write_error(path: Path, e: OSError) -> JobrunError:
    import errno

    if isinstance(e, safefs.UnsafeFile):
        return UsageError(f"refusing to write {path}: {e.strerror}",
                          hint="remove it; jobrun writes only regular files of its own in a run directory")
    why = e.strerror or str(e)
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = f"make {path if path.is_dir() else path.parent} writable (a new run can also take another --run-dir)"
    elif e.errno == errno.ENOSPC:
        hint = "free some disk space"
    else:
        hint = "check the path and its permissions"
    return UsageError(f"cannot write {path}: {why}", hint=hint)
