"""Starting jobs: `jobrun train` and `jobrun resume`.

    train:  compile the plan (refused with its errors), check and create the run
            directory, write plan.yaml and run.json, start the workers
    resume: the run's plan (with new overrides), the epoch to go on from (checksummed),
            then the workers

On one host this process holds the run directory's lock and starts the workers
(:mod:`jobrun.runner.workers`: one replica runs here, N through torch's elastic
launcher). Under `torchrun` each rank runs these commands itself, on one host or
several (:mod:`jobrun.runner.hosts`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml

from jobrun import __version__, hints, signals, store
from jobrun.errors import CheckpointError, Interrupted, PlanError, UsageError
from jobrun.plans import collectives, inputs, ir
from jobrun.plans.compile import compile_tree
from jobrun.plans.keys import NODE_NAME
from jobrun.plans.load import load_file, to_plain
from jobrun.plans.overrides import apply_sets
from jobrun.records_schema import RunInfo
from jobrun.runner.devices import device_for
from jobrun.runner.pick import NoCheckpoint, pick_epoch, replicas_text
from jobrun.runner.planchanges import beyond_extending, restored
from jobrun.runner.resuming import Resuming
from jobrun.runner.rundir import RunDir, RunTaken
from jobrun.runner.runs import new_run_path
from jobrun.runner.workers import Launch, start

# -- entry points (called by the CLI) -------------------------------------------------------


def train(plan_path: str, run_dir: str | None, sets: tuple[str, ...], replicas: int | None,
          device: str | None, overwrite: bool = False, max_restarts: int | None = None,
          profile: int | None = None) -> int:
    if under_torchrun():
        from jobrun.runner import hosts

        _ready()
        _no_profile_here(profile)
        return hosts.train(plan_path, run_dir, sets, replicas, device, overwrite, max_restarts)
    src = Path(plan_path).resolve()
    for tries in range(20, 0, -1):  # trains started at once take the next numbers in turn
        rdir: list[Path] = []
        warnings: list[Any] = []
        plan, stored = compile_for_run(plan_path, sets, run_dir, new_run=rdir, warnings=warnings)
        inputs.check(plan, src.parent, rdir[0].resolve())  # a missing data file, before any directory is made
        run = RunDir(rdir[0], plan)
        if run_dir is None and os.path.lexists(run.path) and tries > 1:
            continue  # another `train` took this number since it was picked (and may have saved in it)
        run.check_can_train(run.checkpoints, overwrite)
        _ready()  # everything above is refused in a fraction of a second, without torch
        inputs.check_code(plan, src.parent)  # a module or name not found, before any directory is made
        launch = Launch(run.path, src.parent, device or plan.device, None, _replicas(plan, replicas),
                        plan.max_restarts if max_restarts is None else max_restarts, profile=profile)
        device_for(launch.device, launch.replicas, select=False)  # refuse a device now, before writing anything
        collectives.refuse(plan, launch.replicas)  # `--replicas 2` of a plan whose threads would race
        try:
            run.create(new=run_dir is None)
            break
        except RunTaken:
            if tries == 1:
                raise
    hints.act_on(run.path)
    said = print_warnings(warnings)  # once, now that the plan runs
    if run_dir is None:
        said.append(f"run directory {run.path}")
        print(said[-1], file=sys.stderr)
    with run.lock(), run.lock_checkpoints(run.checkpoints):
        run.check_can_train(run.checkpoints, overwrite)
        if overwrite:
            run.clear(keep=src)
        with _stop_recorded(run):
            run.start(yaml.safe_dump(stored, sort_keys=False), new_run_info(plan, src, sets, launch))
            to_console_log(run, said)  # what was said before console.log was there
            return start(launch, False, plan)


def to_console_log(run: RunDir, lines: list[str]) -> None:
    """Add ``lines`` to the run's console.log (a full disk: the run goes on without)."""
    from jobrun import safefs

    if lines:
        with suppress(OSError):
            fd = safefs.open_write(run.console_file, append=True)
            try:
                safefs.write_all(fd, "".join(line + "\n" for line in lines).encode())
            finally:
                os.close(fd)


def resume(run_dir: str | None, epoch: int | str | None, sets: tuple[str, ...] = (),
           replicas: int | None = None, max_restarts: int | None = None, force: bool = False,
           profile: int | None = None) -> int:
    if under_torchrun():
        from jobrun.runner import hosts

        _ready()
        _no_profile_here(profile)
        return hosts.resume(run_dir, epoch, sets, replicas, max_restarts, force)
    run = RunDir(Path(run_dir)) if run_dir else RunDir.latest()
    run.info()  # a directory that is not a run is refused before anything is written
    said: list[str] = []  # what it prints before the run goes on: console.log's too
    with run.lock(), ExitStack() as held:
        plan, changes, stored = resume_plan(run, sets, said)
        run.metrics_lines()  # a damaged line is refused before anything changes
        ckpt_dir = checkpoints_of(run, plan)
        held.enter_context(run.lock_checkpoints(ckpt_dir))
        info = run.info()
        n = replicas or (info.replicas or 1)
        epoch = asked = best_or(epoch, ckpt_dir, plan, run)
        if already_finished(run, epoch, changes, plan):
            return 0
        inputs.check(plan, run.plan_dir, run.path.resolve())
        _ready()
        inputs.check_code(plan, run.plan_dir)  # before run.json records the resume
        device = str(info.device or plan.device)
        store.clean(ckpt_dir)  # what a kill during a save or prune left behind
        device_for(device, n, select=False)
        collectives.refuse(plan, n)
        restarts = restarts_of(info, plan, max_restarts)
        try:
            epoch, saved = pick_epoch(ckpt_dir, plan, n, epoch, change_ok=replicas is not None, said=said)
        except (NoCheckpoint, UsageError) as e:  # UsageError: an --epoch never saved
            never = _never_saved(info, ckpt_dir)
            if not isinstance(e, NoCheckpoint) and not never:
                raise
            if asked is None and not sets and never:
                return _start_again(run, Launch(run.path, run.plan_dir, device, None, n, restarts,
                                                profile=profile), plan, said)
            moved = [c for c in changes if c.startswith("checkpoint.dir:")]
            if moved:  # the run's checkpoints are where it was
                e.hint = (f"this resume moves checkpoint.dir ({moved[0]}) and the run's checkpoints are "
                          "not there: resume without that override, or copy them into it first")
            else:
                e.hint = _train_again(run, info, sets) or e.hint
            if never or moved:  # nothing to resume from: refused as bad input, as --epoch N is (2)
                raise UsageError(e.message, hint=e.hint) from None
            raise
        record = resuming(plan, epoch, sets, changes, stored, n, saved, restarts,
                          newer_epochs(ckpt_dir, epoch, asked, list(plan.nodes)), said,
                          went_back=asked is not None)
        # A plan changed on purpose may make init build other things: warned, not refused.
        launch = Launch(run.path, run.plan_dir, device, epoch, n, restarts, resume_world=saved,
                        force=force or beyond_extending(changes), profile=profile, resuming=record)
        to_console_log(run, said)
        return start(launch, False, plan)


# -- shared by both ways of starting --------------------------------------------------------


def _ready() -> None:
    """The checks that need no torch are done: import it (a signal still ends the process
    at once), then a signal raises Interrupted as everywhere else."""
    signals.import_torch()
    signals.interruptible()


def _no_profile_here(profile: int | None) -> None:
    if profile is not None:
        print("warning: --profile is not supported under torchrun yet: this run is not "
              "profiled (profile one host with `jobrun train --replicas N --profile`)", file=sys.stderr)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def compile_for_run(plan_path: str, sets: tuple[str, ...], run_dir: str | None,
                    new_run: list[Path] | None = None, warnings: list[Any] | None = None):
    """The plan to train, refused with its errors, and the tree to store. ``new_run``: a
    list to put the run directory in; without --run-dir that is a new runs/<job>/<N>
    (without ``new_run``, as under torchrun where every rank must name the same one:
    runs/<job>). ``warnings``: a list to put analyze's warnings in."""
    tree = load_file(plan_path)
    apply_sets(tree, sets)
    stored = to_plain(tree)
    job = tree.get("job")
    if run_dir:
        rdir = Path(run_dir)
    elif new_run is not None and isinstance(job, str) and NODE_NAME.match(job) and ".." not in job:
        rdir = new_run_path(job)
    else:
        rdir = Path("runs") / str(job)  # a bad job name is refused by compile_tree below
    if new_run is not None:
        new_run.append(rdir)
    plan = compile_tree(tree, plan_path, (), run_dir=str(rdir.resolve()),
                        plan_dir=str(Path(plan_path).resolve().parent))
    found = refuse_errors(plan)
    if warnings is not None:
        warnings += found
    return plan, stored


def new_run_info(plan: ir.Plan, src: Path, sets: tuple[str, ...], launch: Launch) -> dict[str, Any]:
    return {
        "job": plan.job, "source": str(src), "plan_dir": str(launch.plan_dir),
        "plan_sha256": hashlib.sha256(src.read_bytes()).hexdigest(), "sets": list(sets),
        "replicas": launch.replicas, "max_restarts": launch.max_restarts, "device": launch.device,
        "started": time.time(), "status": "running", "jobrun": __version__,
    }


def refuse_errors(plan: ir.Plan) -> list[Any]:
    """A plan the analyzer finds errors in does not run: they are the message. Returns
    its warnings (Diagnostics)."""
    from jobrun.plans.analyze import analyze

    found = analyze(plan)
    errors = [d for d in found if d.severity == "error"]
    if len(errors) == 1:
        raise PlanError(errors[0].message, errors[0].pos,
                        errors[0].hint or "`jobrun analyze PLAN` lists every problem")
    if errors:  # each hint under its error; the last line says where to see them all
        first = errors[0]
        lines = [first.message, *([f"  hint: {first.hint}"] if first.hint else []),
                 *(d.format() for d in errors[1:])]
        raise PlanError("\n".join(lines), first.pos,
                        f"{len(errors)} errors; `jobrun analyze PLAN` lists them with the warnings")
    return found


def print_warnings(warnings: list[Any]) -> list[str]:
    """analyze's warnings, one line each (`jobrun analyze` adds each one's fix): yellow
    on a terminal, as the run's own warnings are (rich is imported only then). The lines
    said, as plain text."""
    lines = [f"{d.pos}: {d.message}" for d in warnings]
    if lines and sys.stderr.isatty():
        from rich.console import Console
        from rich.text import Text

        console = Console(stderr=True, highlight=False)
        for line in lines:
            console.print(Text.assemble(("warning:", "bold yellow"), " ", line), soft_wrap=True)
    else:
        for line in lines:
            print(f"warning: {line}", file=sys.stderr)
    if not lines:
        return []
    fix = f"  (`jobrun analyze PLAN` shows how to fix {'it' if len(lines) == 1 else 'them'})"
    print(fix, file=sys.stderr)
    return [*(f"warning: {line}" for line in lines), fix]


def resume_plan(run: RunDir, sets: tuple[str, ...],
                said: list[str] | None = None) -> tuple[ir.Plan, list[str], Any]:
    """The plan a resume runs: the run's own, with ``sets`` applied (what changed, and
    the tree to store, when there are any). The warnings printed are added to ``said``."""
    said = [] if said is None else said
    if run.source_changed():
        source = run.info().source
        what = "changed since the run started" if source and Path(source).is_file() else "is gone"
        _say(said, f"warning: {source or 'the plan file'} {what}; resume uses the plan stored in "
                   f"{run.plan_file} (give changes as KEY=VALUE overrides)")
    if not sets:
        return run.plan(), [], None
    original = run.plan()  # before changed_plan, which makes the changed one the run's
    plan, changes, stored = run.changed_plan(sets)
    found = refuse_errors(plan)
    if found:  # the warnings the overrides brought (max_epochs=5 past a reader's one pass)
        from jobrun.plans.analyze import analyze

        known = {(d.code, d.pos) for d in analyze(original)}
        said += print_warnings([d for d in found if (d.code, d.pos) not in known])
    return plan, changes, stored


def checkpoints_of(run: RunDir, plan: ir.Plan) -> Path:
    ckpt_dir = RunDir(run.path, plan).checkpoints
    if ckpt_dir is None:
        raise UsageError(f"the job in {run.path} writes no checkpoints, so it cannot be resumed",
                         hint="add a `checkpoint:` block to the plan and train again")
    return ckpt_dir


def best_or(epoch: int | str | None, ckpt_dir: Path, plan: ir.Plan, run: RunDir, *,
            hosts: bool = False) -> int | None:
    """``--epoch best``: the best epoch by the plan's checkpoint.best; any other value as
    it is. ``hosts``: rank 0 of a run on several hosts, whose directory may hold only its
    host's ranks (no shared disk): an epoch counts when the ranks here are intact, and
    the ranks check together that all of them hold it (pick.pick_epoch)."""
    if epoch != "best":
        return epoch
    from jobrun.runner.monitor import best_epoch

    infos, nodes = store.list_checkpoints(ckpt_dir), list(plan.nodes)
    here = store.intact_epochs(nodes, infos) if hosts else []
    return best_epoch(infos, nodes, plan, str(run.path), here)


def newer_epochs(ckpt_dir: Path, epoch: int, asked: Any, nodes: list[str]) -> list[int]:
    """The epochs saved after the one a resume goes on from, when the user asked for that
    one (--epoch): the resume trains them again. Going on from the newest usable epoch,
    the newer ones are damaged or incomplete, and `pick_epoch` said so: a save of the
    epoch replaces them, but for a damaged save it may not write over (store.in_the_way),
    which is moved aside (kept) too."""
    newer = [info.epoch for info in store.list_checkpoints(ckpt_dir) if info.epoch > epoch]
    return newer if asked is not None else store.in_the_way(ckpt_dir, nodes, newer)


def already_finished(run: RunDir, epoch: int | None, changes: list[str], plan: ir.Plan) -> bool:
    info = run.info()
    if epoch is None and info.status == "finished" and not changes:
        # the key that stops it: max_steps if the plan has it (a plan with both: either)
        keys = ["max_epochs=N", "max_steps=N"] if plan.max_epochs and plan.max_steps else \
            ["max_steps=N"] if plan.max_steps is not None else ["max_epochs=N"]
        early = _stopped_early(run, plan, info.last_epoch)
        if early is not None:  # a larger max_epochs would stop again at once
            keys = ["early_stop.patience=N"]
        more = " or ".join(f"`{hints.command('resume', key, run=run.path)}`" for key in keys)
        print(f"{run.path}: job {info.job!r} already finished at epoch {info.last_epoch}"
              f"{f', stopped early: {early}' if early else ''}; "
              f"nothing to do (train on with {more}, or again from epoch E with --epoch E)")
        return True
    return False


def _stopped_early(run: RunDir, plan: ir.Plan, epoch: int | None) -> str | None:
    """Why early_stop ended the run after ``epoch``, by that checkpoint's state; None when
    it did not (or no checkpoint says)."""
    from jobrun.runner.monitor import EARLY_STOP_META, EarlyStopping

    ckpt_dir = RunDir(run.path, plan).checkpoints
    if plan.early_stop is None or ckpt_dir is None or epoch is None:
        return None
    node = next(iter(plan.nodes))
    try:
        info = next((i for i in store.list_checkpoints(ckpt_dir) if i.epoch == epoch and node in i.nodes), None)
    except (CheckpointError, OSError):
        return None
    meta = (info.nodes[node].meta if info is not None else None) or {}
    return EarlyStopping.restored(plan.early_stop, meta.get(EARLY_STOP_META))[0].reason(epoch)


def restarts_of(info: RunInfo, plan: ir.Plan, given: int | None) -> int:
    """--max-restarts, else what the run started with, else the plan's."""
    if given is not None:
        return given
    return plan.max_restarts if info.max_restarts is None else info.max_restarts


def resuming(plan: ir.Plan, epoch: int, sets: tuple[str, ...], changes: list[str], stored: Any,
             replicas: int, saved: int, restarts: int, newer: list[int] = (),  # type: ignore[assignment]
             said: list[str] | None = None, went_back: bool = True) -> Resuming:
    """What the resume of ``plan`` will record once its checkpoint is restored
    (jobrun.runner.resuming); what it changes is said now (and added to ``said``), and
    which later epochs it trains again (``newer``; ``went_back``: intact ones, which --epoch
    chose to train again, else the damaged ones pick_epoch skipped, and said so)."""
    said = [] if said is None else said
    if changes:
        _warn_changes(changes, said)
        _warn_restored(changes, stored, plan, epoch, said)
    if newer and went_back:
        # Every epoch after `epoch` is trained again, also those `keep` pruned before.
        what = f"epoch {newer[-1]} is" if newer[-1] == epoch + 1 else f"epochs {epoch + 1}-{newer[-1]} are"
        _say(said, f"note: going on from epoch {epoch} of a run saved up to epoch {newer[-1]}: {what} "
                   f"trained again; the checkpoints after epoch {epoch} are removed once it is restored, "
                   "and the metrics lines and files they saved are replaced (copy the run directory "
                   "first to keep them)")
    if saved != replicas:
        _say(said, f"resuming with {replicas_text(replicas)} from a checkpoint of {saved}")
    return Resuming(epoch, tuple(sets), tuple(changes), stored if changes else None, replicas, saved,
                    restarts, tuple(newer))


def _never_saved(info: RunInfo, ckpt_dir: Path) -> bool:
    """Whether the run stopped before its first checkpoint: no epoch ran and its checkpoint
    directory holds none, complete or not (a damaged one is for the user to look at)."""
    return not info.last_epoch and not store.list_checkpoints(ckpt_dir)


def _start_again(run: RunDir, launch: Launch, plan: ir.Plan, said: list[str]) -> int:
    """`resume` of a run that stopped before its first checkpoint (a scheduler's signal
    during init): it starts again from init, in its own directory, with its own plan, as
    a restarted rank does. A job script that resumes whatever run.json it finds (SLURM's
    requeue) then never loses a job to "no complete checkpoint"."""
    _say(said, "note: the run stopped before its first checkpoint, so nothing was saved: "
               "it starts again from init")
    to_console_log(run, said)
    run.truncate_metrics(-1)  # what its init logged: logged again
    record = {k: v for k, v in run.info().record.items() if k != "ended"}
    with _stop_recorded(run):
        run.write_info({**record, "status": "running", "started": time.time(), "error": None, "error_at": None})
        return start(launch, False, plan)


@contextmanager
def _stop_recorded(run: RunDir) -> Iterator[None]:
    """Around writing run.json's `running` and starting the job: a signal before the job
    runner records how the run ends (its handler not installed yet) leaves the run
    interrupted, not running, which `jobrun runs` would call died."""
    try:
        yield
    except Interrupted as e:
        if run.info_file.exists():
            run.record_end("interrupted", e, keep_ended=True)
        raise


def _train_again(run: RunDir, info: RunInfo, sets: tuple[str, ...]) -> str | None:
    """The command that starts a run that stopped before its first checkpoint again, in
    its own directory (a run without checkpoints may be trained over); when epochs ran and
    their checkpoints are gone or damaged, in a new directory (the damaged ones stay).
    Either trains with the run's overrides, then the ones this resume was given."""
    if not info.source:
        return None
    given = [*(info.sets or []), *sets]
    if info.last_epoch:
        return (f"no checkpoint of the {info.last_epoch} epoch(s) it ran is usable "
                f"(`{hints.command('ckpt verify', run=run.path)}` says why): "
                f"train it again in a new run directory with `{hints.train_again(info.source, given)}`")
    again = hints.train_again(info.source, given, run.path)
    return f"it stopped before its first checkpoint: start it again with `{again}`"


def _warn_changes(changes: list[str], said: list[str]) -> None:
    for change in changes:
        _say(said, f"resuming with {change}")
    if all(c.startswith("vars.") for c in changes):
        _say(said, "note: no key of the plan uses the changed var(s) now (an earlier override may have "
                   "replaced a use, e.g. max_epochs=5): the run goes on as before")
    if any(c.startswith("max_steps:") for c in changes):
        # The steps go on from the checkpoint's exactly; an epoch that the old max_steps
        # ended mid-loop is not taken up again (its later steps run in the next epoch).
        _say(said, "note: the steps go on exactly from the checkpoint's global step; an epoch the old "
                   "max_steps cut short is not finished (its later steps run in the next epoch)")
    if beyond_extending(changes):
        _say(said, "warning: the plan changed beyond max_epochs, max_steps and early_stop.patience: the result is no longer the "
                   "one an uninterrupted run would give (the changes are recorded in run.json); objects "
                   "init builds and the checkpoint restores (a model, an optimizer's lr, a scheduler) "
                   "keep their saved state")


def _warn_restored(changes: list[str], stored: Any, plan: ir.Plan, epoch: int, said: list[str]) -> None:
    """An override of what the checkpoint restores (an optimizer's lr) does nothing: as
    in Lightning and HF Trainer, the saved state wins. Say so, by name."""
    if not changes:
        return
    from jobrun.runner.checkpoints import held_blobs

    held = {name for names in held_blobs(plan).values() for name in names}
    for change, outs in restored(changes, stored, held):
        _say(said, f"warning: {change} has no effect: checkpoint epoch {epoch} restores "
                   f"{', '.join(map(repr, outs))} with its saved state (an optimizer's lr and "
                   "momentum too); to train with the new value, start a new run with it "
                   "(`jobrun train PLAN KEY=VALUE --run-dir NEW`)")


def _say(said: list[str], line: str) -> None:
    """A line on stderr, kept in ``said`` for the run's console.log."""
    said.append(line)
    print(line, file=sys.stderr)


def _replicas(plan: ir.Plan, override: int | None) -> int:
    if override is not None:
        return override
    if plan.replicas == "auto":
        try:
            import torch

            return max(1, torch.cuda.device_count())
        except Exception:  # noqa: BLE001 - no usable CUDA means one replica
            return 1
    return int(plan.replicas)
