"""`jobrun train` and `resume` under torchrun: every rank runs the command, on one host
or several, with no shared filesystem needed.

    rank 0                                      every other rank
    the plan (compiled, checked), its run
    directory (checked, created, locked),
    run.json; publishes the plan text and  -->  reads them from the rendezvous store
    the settings in the rendezvous store        its host's first rank prepares the host's
                                                run directory (a copy of plan.yaml and
                                                run.json, unless it is rank 0's)
    all: join the process group; agree that every host is ready; on resume, pick the
    epoch together (each rank checks the files it restores); run the worker

Rank 0's plan is used everywhere (the other hosts' plan files are not read); paths in it
that are relative to the plan (data, model code) resolve against each host's own plan
directory. Each host keeps its own ranks' checkpoints under its own run directory;
only rank 0 writes metrics, console.log and the run's status. A rank restarted by
torchrun's agent (--max-restarts) resumes from the latest checkpoint all ranks hold.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from jobrun import __version__, store
from jobrun.errors import JobrunError, UsageError
from jobrun.plans import collectives, inputs, ir
from jobrun.plans.compile import compile_text
from jobrun.runner import group
from jobrun.runner.devices import device_for
from jobrun.runner.launch import (
    already_finished,
    best_or,
    checkpoints_of,
    compile_for_run,
    new_run_info,
    newer_epochs,
    print_warnings,
    restarts_of,
    resume_plan,
    resuming,
    to_console_log,
)
from jobrun.runner.pick import pick_epoch
from jobrun.runner.planchanges import beyond_extending
from jobrun.runner.rundir import RunDir
from jobrun.runner.workers import Launch, restart_count, worker


def train(plan_path: str, run_dir: str | None, sets: tuple[str, ...], replicas: int | None,
          device: str | None, overwrite: bool, max_restarts: int | None) -> int:
    world = _check_replicas(replicas)
    here = Path(plan_path).resolve().parent
    with ExitStack() as held:
        rdzv = group.rendezvous_store()
        lead, settings = _settle(held, rdzv, lambda lead: lead.train(plan_path, run_dir, sets, device,
                                                                     overwrite, max_restarts, world))
        return _go(held, settings, lead, run_dir, rdzv, overwrite, lambda run: here)


def resume(run_dir: str | None, epoch: int | str | None, sets: tuple[str, ...], replicas: int | None,
           max_restarts: int | None, force: bool = False) -> int:
    world = _check_replicas(replicas)
    with ExitStack() as held:
        rdzv = group.rendezvous_store()
        lead, settings = _settle(held, rdzv, lambda lead: lead.resume(run_dir, epoch, sets, replicas,
                                                                      max_restarts, world, force))
        if settings.get("done"):
            return 0
        return _go(held, settings, lead, run_dir, rdzv, False, _stored_plan_dir)


def _settle(held: ExitStack, rdzv: Any, settle: Callable[[_Lead], dict[str, Any]]
            ) -> tuple[_Lead | None, dict[str, Any]]:
    """The run's settings: rank 0 leads (``settle(lead)`` makes them) and publishes them,
    the other ranks follow (they fetch them)."""
    if _rank() == 0:
        lead = _Lead(held)
        return lead, lead.publish(rdzv, lambda: settle(lead))
    return None, _follow(rdzv)


def _rank() -> int:
    return int(os.environ["RANK"])


def _check_replicas(replicas: int | None) -> int:
    world = int(os.environ["WORLD_SIZE"])
    if replicas is not None and replicas != world:
        raise UsageError(f"--replicas {replicas}, but torchrun started {world} processes",
                         hint="torchrun's --nnodes and --nproc-per-node set the number of ranks; "
                              f"give --replicas {world} (or none)")
    return world


class _Lead:
    """Rank 0's part: it owns the run directory (holding its lock for the whole job)."""

    def __init__(self, held: ExitStack) -> None:
        self.held = held
        self.run: RunDir | None = None
        self.plan: ir.Plan | None = None  # compiled from the user's file: messages point there
        self.after_pick: Any = None
        self.said: list[str] = []  # what it printed before the run went on: console.log's too

    def publish(self, rdzv: Any, settle: Any) -> dict[str, Any]:
        """The settings ``settle`` makes, published for the other ranks; a refusal is
        published too, so that they stop with it instead of waiting."""
        try:
            settings = settle()
        except JobrunError as e:
            group.publish(rdzv, "settings", {"refused": e.exit_code})
            raise
        settings["token"] = token = uuid.uuid4().hex
        if self.run is not None:
            # The token: how hosts tell this directory apart. The hosts: how `ckpt list`
            # knows that the other ranks' files may be on other hosts.
            self.run.update_info(launch_token=token, hosts=int(os.environ.get("GROUP_WORLD_SIZE", "1")))
        group.publish(rdzv, "settings", settings)
        return settings

    def train(self, plan_path: str, run_dir: str | None, sets: tuple[str, ...], device: str | None,
              overwrite: bool, max_restarts: int | None, world: int) -> dict[str, Any]:
        warnings: list[Any] = []
        plan, stored = compile_for_run(plan_path, sets, run_dir, warnings=warnings)
        run = RunDir(Path(run_dir) if run_dir else Path("runs") / plan.job, plan)
        if restart_count() and run.info_file.is_file():
            return self._existing(RunDir(run.path))  # torchrun restarted the ranks: go on
        src = Path(plan_path).resolve()
        restarts = plan.max_restarts if max_restarts is None else max_restarts
        launch = Launch(run.path, src.parent, device or plan.device, None, world, restarts)
        device_for(launch.device, 1, select=False)
        collectives.refuse(plan, world)
        run.check_can_train(run.checkpoints, overwrite)
        inputs.check(plan, src.parent, run.path.resolve())  # as on one host: before the directory
        inputs.check_code(plan, src.parent)
        run.create()
        self.held.enter_context(run.lock())
        self.held.enter_context(run.lock_checkpoints(run.checkpoints))
        run.check_can_train(run.checkpoints, overwrite)
        if overwrite:
            run.clear(keep=src)
        text = yaml.safe_dump(stored, sort_keys=False)
        run.start(text, new_run_info(plan, src, sets, launch))
        to_console_log(run, print_warnings(warnings))  # once, now that the plan runs
        self.run, self.plan = run, plan
        return _settings(run, plan, text, launch.device, world, restarts, epoch=None, resume=False)

    def _existing(self, run: RunDir) -> dict[str, Any]:
        self.held.enter_context(run.lock())
        plan, info = run.plan(), run.info()
        self.held.enter_context(run.lock_checkpoints(run.checkpoints))
        self.run, self.plan = run, plan
        return _settings(run, plan, run.plan_text(), str(info.device or plan.device),
                         (info.replicas or 1), restarts_of(info, plan, None), epoch=None,
                         resume=False)

    def resume(self, run_dir: str | None, epoch: int | str | None, sets: tuple[str, ...],
               replicas: int | None, max_restarts: int | None, world: int,
               force: bool) -> dict[str, Any]:
        run = RunDir(Path(run_dir)) if run_dir else RunDir.latest()
        run.info()  # a directory that is not a run is refused before anything is written
        self.held.enter_context(run.lock())
        plan, changes, stored = resume_plan(run, sets, self.said)
        run.metrics_lines()  # a damaged line is refused before anything changes
        ckpt_dir = checkpoints_of(run, plan)
        self.held.enter_context(run.lock_checkpoints(ckpt_dir))
        info = run.info()
        epoch = best_or(epoch, ckpt_dir, plan, run, hosts=run.several_hosts())
        if already_finished(run, epoch, changes, plan):
            return {"done": True}
        inputs.check(plan, run.plan_dir, run.path.resolve())  # as on one host: before run.json records it
        collectives.refuse(plan, world)
        inputs.check_code(plan, run.plan_dir)
        store.clean(ckpt_dir)
        restarts = restarts_of(info, plan, max_restarts)
        text = yaml.safe_dump(stored, sort_keys=False) if changes else run.plan_text()
        self.run, self.plan = run, plan
        self.after_pick = lambda e, saved: resuming(plan, e, sets, changes, stored, world, saved, restarts,
                                                    newer_epochs(ckpt_dir, e, epoch, list(plan.nodes)), self.said,
                                                    went_back=epoch is not None)
        settings = _settings(run, plan, text, str(info.device or plan.device), world, restarts,
                             epoch=epoch, resume=True)
        settings["change_ok"] = replicas is not None
        settings["force"] = force or beyond_extending(changes)
        return settings


def _settings(run: RunDir, plan: ir.Plan, text: str, device: str, world: int, restarts: int, *,
              epoch: int | None, resume: bool) -> dict[str, Any]:
    return {"job": plan.job, "plan": text, "name": str(run.plan_file), "device": device,
            "replicas": world, "max_restarts": restarts, "epoch": epoch, "resume": resume,
            "change_ok": False}


def _follow(rdzv: Any) -> dict[str, Any]:
    try:
        settings = group.fetch(rdzv, "settings")
    except Exception as e:  # noqa: BLE001 - the store's timeout or a lost connection
        raise UsageError(f"rank {_rank()} got no run settings from rank 0 ({e})",
                         hint="rank 0's messages say why; check that every host runs the same command") from None
    if "refused" in settings:
        raise SystemExit(settings["refused"])  # rank 0 says why
    return settings


def _stored_plan_dir(run: RunDir) -> Path:
    """The plan directory this host's run directory recorded (on resume)."""
    try:
        return run.plan_dir
    except JobrunError:
        return run.path.resolve()


def _go(held: ExitStack, settings: dict[str, Any], lead: _Lead | None, run_dir: str | None,
        rdzv: Any, overwrite: bool, plan_dir_of: Any) -> int:
    """Every rank: the host's run directory, the process group, the epoch, the worker."""
    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    if lead is not None:
        path = lead.run.path
    else:
        path = Path(run_dir) if run_dir else Path("runs") / settings["job"]
    run = RunDir(path)
    if lead is None:
        plan_dir = plan_dir_of(run)
        plan = compile_text(settings["plan"], settings["name"], run_dir=str(path.resolve()),
                            plan_dir=str(plan_dir))
    else:
        plan_dir, plan = lead.run.plan_dir, lead.plan
    run = RunDir(path, plan)
    problems: list[str] = []
    if lead is None and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        problems = _prepare_host(held, run, plan_dir, settings, overwrite)
    group.start(device_for(settings["device"], world), rdzv)
    problems = [p for theirs in group.gather(problems) for p in theirs]
    epoch = saved = record = None
    try:
        if problems:
            raise UsageError(problems[0], hint="every host needs a run directory it can use")
        if settings["resume"]:
            if lead is None and int(os.environ.get("LOCAL_RANK", 0)) == 0:
                store.clean(checkpoints_of(run, plan))  # this host's own leftovers
            group.gather(None)  # nobody lists checkpoints while they are cleaned
            epoch, saved = pick_epoch(checkpoints_of(run, plan), plan, world, settings["epoch"],
                                      change_ok=settings["change_ok"], rank=rank, gather=group.gather,
                                      said=lead.said if lead else None)
            if lead is not None:
                record = lead.after_pick(epoch, saved)  # written by the job once it restored
                to_console_log(lead.run, lead.said)
    except JobrunError as e:
        if lead is None:
            raise SystemExit(e.exit_code) from None  # every rank found it; rank 0 says it
        if not settings["resume"]:
            lead.run.record_end("failed", e)  # the run it has just started
        raise
    launch = Launch(path, plan_dir, settings["device"], epoch, world, settings["max_restarts"],
                    resume_world=saved, force=settings.get("force", False), resuming=record)
    return worker(launch, plan)


def _prepare_host(held: ExitStack, run: RunDir, plan_dir: Path, settings: dict[str, Any],
                  overwrite: bool) -> list[str]:
    """This host's run directory, when it is not rank 0's: checked like rank 0's, locked,
    with a copy of the plan and a run.json naming it a host copy. Its problems."""
    rank = _rank()
    try:
        if run.info_file.is_file() and run.info().launch_token == settings["token"]:
            return []  # rank 0's own directory: a shared filesystem
    except JobrunError:
        pass
    try:
        if not settings["resume"] and not restart_count():
            run.check_can_train(run.checkpoints, overwrite)
        elif run.info_file.is_file() and run.info().job != settings["job"]:
            raise UsageError(f"it holds a run of job {run.info().job!r}, not {settings['job']!r}")
        run.create()
        held.enter_context(run.lock())
        if overwrite and not settings["resume"]:
            run.clear()
        text = settings["plan"]
        run.write_plan(text)
        run.write_info({
            "job": settings["job"], "host_copy_of": settings["name"], "source": str(run.plan_file),
            "plan_dir": str(plan_dir), "plan_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "sets": [], "replicas": settings["replicas"], "device": settings["device"],
            "started": time.time(), "status": "running", "jobrun": __version__,
            "note": "rank 0's run directory holds the run's status, metrics and console.log",
        })
    except JobrunError as e:
        return [f"rank {rank} ({run.path}): {e.message}"]
    return []
