"""The job runner: init, checkpoint 0, epochs until a stop condition, then download, exit.

    run init                       (on resume: init rebuilds the objects, then every
    save checkpoint 0               node's blobs and RNG state are restored from E)
    for epoch = 1, 2, ...:
        run the epoch group; fetch the task outputs
        save checkpoint `epoch` (every N epochs, and always the last)
        stop when a stop_when output is truthy, early_stop says so or epoch == max_epochs
    upload the last checkpoints; run download; run exit

Every rank of a data-parallel job runs this same loop on its own device. The saves and
the restore are the runner's base class, in :mod:`jobrun.runner.checkpoints`.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from jobrun import hints, signals, store
from jobrun.errors import CheckpointError, Interrupted, JobrunError, RunError, said
from jobrun.ops.context import OpContext
from jobrun.ops.core import truthy
from jobrun.plans import ir, precision
from jobrun.records_schema import MetricsRecord
from jobrun.runner import clock, fingerprint, profile, rng, trackers
from jobrun.runner.checkpoints import Checkpoints, held_blobs, short
from jobrun.runner.codegen_task import shared_names
from jobrun.runner.concurrency import run_concurrently
from jobrun.runner.display import Display
from jobrun.runner.executor import CompiledTask, NodeRuntime
from jobrun.runner.monitor import Watch
from jobrun.runner.records import Metrics, TensorBoard
from jobrun.runner.resuming import Resuming
from jobrun.runner.rundir import RunDir
from jobrun.runner.saves import Writer
from jobrun.runner.throughput import EpochRates, Feed


@dataclass
class JobConfig:
    plan: ir.Plan
    run_dir: Path
    plan_dir: Path
    device: str
    rank: int = 0
    world_size: int = 1
    resume_epoch: int | None = None
    resume_verified: bool = False  # the launcher hashed every rank of resume_epoch just now
    force: bool = False  # resume even when init built other things than when the run started
    resume_world: int | None = None  # the ranks that saved resume_epoch (None: world_size)
    restart: dict[str, Any] | None = None  # set when the elastic agent restarted the ranks
    resuming: Resuming | None = None  # a resume's record, written once the checkpoint is restored
    profile: bool = False  # time every plan step (train --profile)
    profile_torch: int = 0  # also a torch.profiler trace of this many loop iterations


@dataclass
class EpochResult:
    epoch: int
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    ckpt: str = ""
    rates: dict[str, Any] = field(default_factory=dict)  # samples/s, data wait, peak memory
    step: int | None = None  # the global step at the epoch's end


class JobRunner(Checkpoints):
    def __init__(self, cfg: JobConfig, display: Display | None = None):
        self.cfg = cfg
        self.plan = cfg.plan
        self.rank = cfg.rank
        self.main_rank = cfg.rank == 0
        self.run_dir = RunDir(cfg.run_dir, cfg.plan)
        self.display = display or Display(enabled=self.main_rank, log=self.run_dir.console_file)
        self.metrics = Metrics(self.run_dir.metrics_file if self.main_rank else None)
        self.tensorboard = TensorBoard(cfg.run_dir if self.main_rank else None)
        self.status = "failed"  # how the run ended, for the trackers
        self.completed = 0  # the last epoch that ran to its end (run.json's last_epoch)
        # A resume not restored yet: how it ends is not the run's (the run is as it was).
        self._unrecorded = cfg.resuming is not None
        try:
            self.trackers = trackers.for_run(self.plan, cfg.resume_epoch, self.run_dir, self.display.warn) \
                if self.main_rank and self.plan.loggers else None
        except JobrunError as e:  # a tracker that cannot start: the run failed, not "died"
            self._record("failed", e)
            raise
        self.epoch = 0
        self.group = "init"
        self.save_failures: list[str] = []
        self.unsaved: set[str] = set()
        self._saving = False
        self._failed_save: int | None = None  # this rank's failed save since the ranks last agreed
        self._save_error: BaseException | None = None
        self._pending_signal: int | None = None
        self._stop: Interrupted | None = None  # the stop, once run.json says so
        self._resumable = cfg.resume_epoch is not None  # a checkpoint of this run exists
        self._writer: Writer | None = None
        self._buffers: dict[str, store.Prepared] = {}  # per node: the last async save's copy
        self._last_saved = -1  # the newest epoch written (set by the writer thread when async)
        self.ckpt_dir = self.run_dir.checkpoints
        self.watch = Watch(self.plan)  # early_stop and checkpoint.best
        # What checkpoints hold: per node, the blobs steps after init write or change.
        self.held = held_blobs(self.plan) if self.ckpt_dir is not None else {}
        self.init_fingerprints: dict[str, dict[str, Any]] = {}  # per node: what they do not hold
        self.init_rng: dict[str, dict[str, Any]] = {}  # per node: the random state init left
        self.fsdp_amp = precision.fsdp_amp(self.plan)  # the dtype fsdp gathers parameters in
        self.feed = Feed()  # what `read` ops delivered: the epochs' samples/s and data wait
        self.display.progress["feed"] = self.feed
        self.profile = profile.for_run(cfg.device, cfg.profile_torch, self.run_dir.path,
                                       self.main_rank) if cfg.profile else None
        self.nodes = {name: self._node(name) for name in self.plan.nodes}
        clock.install()  # the global step counts every optimizer step of a task
        shared = shared_names(self.plan)  # per node: what its global workspace can hold
        self.groups = {
            g.name: [CompiledTask(t, self.nodes[t.node], self.profile, self.plan.max_steps, shared[t.node])
                     for t in g.tasks]
            for g in self.plan.groups
        }
        for node in self.nodes.values():
            for tctx in node.task_ctxs:
                tctx.log = self._logger(tctx)
                tctx.load_checkpoint = functools.partial(self._load_named, node)

    # -- set-up ---------------------------------------------------------------------
    def _node(self, name: str) -> NodeRuntime:
        c = self.cfg
        ctx = OpContext(
            node=name, rank=c.rank, world_size=c.world_size, seed=self.plan.seed, device=c.device,
            parallel=self.plan.parallel, fsdp_layers=self.plan.fsdp_layers,
            fsdp_amp=self.fsdp_amp,
            plan_dir=c.plan_dir, run_dir=c.run_dir, progress=self.display.progress,
        )
        _ = ctx.generator  # created now so every task's context shares it
        return NodeRuntime(name, ctx)

    def _logger(self, tctx: OpContext):
        def log(values: dict[str, Any], msg: str | None, step: int) -> None:
            if not self.main_rank:
                return
            self.metrics.write({
                "epoch": self.epoch, "group": self.group, "task": tctx.task, "node": tctx.node,
                "msg": msg, "step": step, "values": values,
            })
            self.tensorboard.write(tctx.task, step, values)
            if self.trackers is not None:
                self.trackers.log(tctx.task, step, values)
            self.display.logged(self.group, self.epoch, tctx.task, values, msg)

        return log

    # -- the loop -------------------------------------------------------------------
    def run(self) -> int:
        """Run the whole job; return the process exit code."""
        stop_names = frozenset(ref.name for ref in self.plan.stop_when)
        with self._signals(), self.display.live(self.plan.job, stop_names):
            try:
                stop = self._start()
                while not stop:
                    stop = self._epoch(self.epoch + 1)
                self._finish()
            except Interrupted as e:
                self._stopped(e.signum)
            except JobrunError as e:
                if self._peer_lost(e):
                    raise  # another rank died: the launcher names it, and may restart
                if signals.requested():  # a collective broke because the others stopped
                    self._stopped(signals.requested())
                self._record("failed", e)
                self.display.to_log(e.format_message())
                raise
            except KeyboardInterrupt:  # raised by the user's code, not by a signal (jobrun's is Interrupted)
                self._stopped(signal.SIGINT)
            except Exception as e:
                # Outside any op: a collective of the runner's that broke because another
                # rank left (that rank's message is the one to show), a DataLoader worker's
                # death (torch raises it in whatever runs, a save too), or a bug of jobrun's.
                from jobrun.ops.loader_failures import is_worker_death, worker_died

                if is_worker_death(e):
                    if signals.requested():  # killed by the signal the ranks are stopping for
                        self._stopped(signals.requested())
                    died = worker_died(e)
                    self._record("failed", died)
                    raise died from e
                error = RunError(f"{type(e).__name__}: {said(e)}")
                error.__cause__ = e
                if self._peer_lost(error):
                    raise error from e
                self._record("failed", error)
                raise
            except BaseException as e:  # a SystemExit... from user code: not "running"
                self._record("failed", RunError(f"{type(e).__name__}: {said(e)}"))
                raise
            finally:
                try:
                    self._wait_for_writer()  # a background save in flight completes first
                except Interrupted:
                    if self.status == "finished":
                        raise
                    # A second signal while the run stops: the stop goes on, closing its files.
                if self.profile is not None and self.main_rank:
                    self.profile.report(self.display, self.run_dir.path)
                self.metrics.close()
                self.tensorboard.close()
                if self.trackers is not None:
                    self.trackers.finish(self.status, self.nodes)
            self._summary()
        return 0

    def _stopped(self, signum: int) -> NoReturn:
        """Record the stop (run.json, console.log): a signal meanwhile waits for it, one
        after it leaves the run's close (a tracker may take minutes) with this message."""
        self._pending_signal = self._pending_signal or signum
        stopped = self._interrupted(signum)
        self._record("interrupted", stopped)
        self.display.to_log(stopped.format_message())
        self._stop, self._pending_signal = stopped, None
        raise stopped from None

    def _peer_lost(self, error: JobrunError) -> bool:
        if self.cfg.world_size == 1:
            return False
        from jobrun.runner.group import lost_peer

        return lost_peer(error)

    def _interrupted(self, signum: int) -> Interrupted:
        """The error for a signal: how to go on, when a checkpoint exists to go on from."""
        why = signals.LAUNCHER_GONE if signum == signal.SIGINT and signals.orphaned() else None
        if self.ckpt_dir is None:
            return Interrupted(signum, hint="this plan writes no checkpoints: train it again", why=why)
        if not self._resumable:
            return Interrupted(signum, during=self.group, why=why)
        if self._unrecorded and hints.acting() is not None:  # the run is as it was: this resume again
            return Interrupted(signum, hint=f"continue with `{hints.resume_again()}`", why=why)
        return Interrupted(signum, hint=f"continue with `{hints.command('resume', run=self.run_dir.path)}`", why=why)

    def _start(self) -> bool:
        self._run_group("init")
        self._fingerprint_init()
        if self.cfg.world_size > 1:  # hosts whose data files differ must not train together
            fingerprint.check_ranks({name: {k: v for k, v in node.globals.items() if k not in self.held.get(
                name, frozenset())} for name, node in self.nodes.items()}, self.plan.init)
        resume = self.cfg.resume_epoch
        if resume is None:
            rng.seed_replica(self.plan.seed, self.rank)  # after init's fingerprint: it is the same on every rank
            self._save(0, stop=False)
            self._stop_if_signalled(0)
            self._resumable = True
            self._agree_on_stop()
            if self.cfg.restart is not None:  # metrics.jsonl was emptied: so is TensorBoard
                self.tensorboard.restart(0, self._logged)
            self._restarted(None)
            return False
        meta = self._restore(resume)
        self._drop_replaced(resume)
        self._prune_resumed(resume)
        self.epoch = self._last_saved = self.completed = resume  # the checkpoint it resumed from is the newest
        logged = self._logged
        if self.cfg.resuming is not None and self.main_rank:
            kept = self.cfg.resuming.record(self.run_dir)  # the run's own from now on (runner/resuming.py)
            logged = lambda: kept  # noqa: E731 - what it read: metrics.jsonl once more costs seconds when long
            self.metrics.reopen()  # the file it appended to was replaced, without the later epochs
        self._record_lost_epoch(resume, meta, logged)
        self.tensorboard.restart(min(node.ctx.step for node in self.nodes.values()), logged)
        self._unrecorded = False
        self._restarted(resume)
        early = self._restore_watch(meta)
        # The stop condition of this plan (a resume may have raised max_epochs), on the
        # outputs the epoch had; checkpoint 0 has none.
        outputs = meta.get("outputs")
        if resume == 0 or not isinstance(outputs, dict):
            return bool(meta.get("stop"))
        return self._should_stop(outputs, resume) or early

    def _epoch(self, epoch: int) -> bool:
        self.epoch = epoch
        for node in self.nodes.values():
            for tctx in node.task_ctxs:
                tctx.epoch = epoch
        rates = EpochRates(self.feed, self.cfg.device)
        t0 = time.perf_counter()
        outputs = self._run_group("epoch")
        self.completed = epoch
        seconds = time.perf_counter() - t0
        early = self.watch.after_epoch(outputs, epoch)
        stop = self._should_stop(outputs, epoch) or early is not None
        result = EpochResult(epoch, outputs, seconds, rates=rates.finish(seconds), step=self.step)
        ck = self.plan.checkpoint
        saving = ck is not None and (epoch % ck.every == 0 or stop)
        if saving:  # a signal from here on waits until the epoch is recorded
            result.ckpt = self._save(epoch, stop=stop, outputs=outputs)
        try:
            self.display.epoch_line(result, self.plan.max_epochs, self.plan.max_steps)
            if self.main_rank:  # the epoch's outputs, for plots and anyone reading the metrics
                self.metrics.write({"epoch": epoch, "step": result.step, "event": "epoch",
                                    "seconds": round(result.seconds, 6), **result.rates,
                                    "outputs": {t: {k: short(v) for k, v in o.items()} for t, o in outputs.items()}})
                if self.trackers is not None:
                    self.trackers.epoch(epoch, outputs, result.rates)
            if early is not None:
                self.display.line(f"stopping early after epoch {epoch}: {early}")
        finally:
            if saving:
                self._stop_if_signalled(epoch)
        self._agree_on_stop()
        if saving:
            self._prune_together()
        return stop

    def _restore_watch(self, meta: dict[str, Any]) -> bool:
        """Early stopping counts on from the checkpoint; whether it says stop already."""
        reason, note = self.watch.restore(meta, self.epoch)
        if note:
            self.display.warn(note)
        if reason is not None:
            self.display.line(f"stopping early (as after epoch {self.epoch}): {reason}")
        return reason is not None

    def _logged(self) -> list[MetricsRecord]:
        """metrics.jsonl's records (a resume cut them at its checkpoint)."""
        return [record for _, record in self.run_dir.metrics_lines() or ()]

    @property
    def step(self) -> int:
        """The global step: the most optimizer steps any node took (most plans have one)."""
        return max(node.ctx.step for node in self.nodes.values())

    def _should_stop(self, outputs: dict[str, dict[str, Any]], epoch: int) -> bool:
        refs = {ref.name: ref for ref in self.plan.stop_when}
        for task_outputs in outputs.values():
            for name, value in task_outputs.items():
                if name in refs:
                    try:
                        if truthy(value):
                            return True
                    except RunError as e:  # a tensor of several values: where it is named
                        raise RunError(f"stop_when {name!r}: {e.message}", refs[name].pos, e.hint) from None
        if self.plan.max_steps is not None and self.step >= self.plan.max_steps:
            return True
        return self.plan.max_epochs is not None and epoch >= self.plan.max_epochs

    def _finish(self) -> None:
        self._wait_for_writer()
        if self.plan.checkpoint is not None and self.plan.checkpoint.background:
            self._prune_together()  # the last epoch written in the background is complete now
        self._check_last_saved()
        ck = self.plan.checkpoint
        if ck is not None and ck.upload and self.ckpt_dir is not None and self.main_rank:
            dest = self.run_dir.under(ck.upload)
            for node in self.nodes:
                held = [r for r in range(self.cfg.world_size)
                        if store.rank_dir(self.ckpt_dir, node, self._last_saved, r).is_dir()]
                if len(held) < self.cfg.world_size:  # several hosts, no shared disk
                    self._warn(
                        f"upload of node {node!r} skipped: {self.ckpt_dir} holds rank "
                        f"{', '.join(map(str, held)) or 'none'} of {self.cfg.world_size} of epoch "
                        f"{self._last_saved} (the others are on other hosts); copy each host's "
                        f"{node}.{self._last_saved} to {dest}, or give the hosts one shared "
                        "checkpoint directory")
                    continue
                try:
                    path = store.upload(self.ckpt_dir, node, self._last_saved, dest)
                    self.display.line(f"uploaded {node} epoch {self._last_saved} to {path}")
                except (JobrunError, OSError) as e:
                    self._warn(f"upload of node {node!r} failed: {e}")
        self._run_group("download")
        self._run_group("exit")
        if self.main_rank:
            self._record("finished")
        signals.job_finished()

    def _check_last_saved(self) -> None:
        """A job whose last epoch has no checkpoint has not finished: it stops before the
        upload, download and exit (a resume runs them after the epochs it trains again).
        With replicas the ranks decide together: every one stops when any save failed."""
        if self.ckpt_dir is None:
            return
        e = self._save_error
        mine = None if self._last_saved == self.completed else {
            "why": e.message if isinstance(e, JobrunError) else said(e) if e is not None else "see the warnings above",
            "fix": e.hint if isinstance(e, JobrunError) and e.hint else f"make {self.ckpt_dir} writable"}
        from jobrun.runner import group

        world = self.cfg.world_size
        gather = group.gather if world > 1 else (lambda x: [x])
        every = gather(mine)
        failed = [(rank, f) for rank, f in enumerate(every) if f is not None]
        if not failed:
            return
        rank, first = failed[0]
        who = "" if world == 1 else f" by rank {rank} of {world}" if len(failed) == 1 \
            else f" by {len(failed)} of {world} ranks (rank {rank}'s reason)"
        # What a resume goes on from: the newest epoch every rank saved, which is not the
        # oldest of each rank's newest when the ranks failed to save different epochs.
        try:
            kept = store.saved_by(self.ckpt_dir, list(self.nodes), self.rank, world)
        except (CheckpointError, OSError):
            kept = [self._last_saved]  # what this rank knows it wrote
        saved = gather(kept)
        newest_saved = max(set(saved[0]).intersection(*saved[1:]), default=-1)
        if newest_saved >= 0:
            newest = f"its newest checkpoint is epoch {newest_saved}"
            how = f"`{hints.command('resume', run=self.run_dir.path)}` trains again from there"
        else:
            newest, how = "no checkpoint of it was saved", f"train it again (`{self._train_again()}`)"
        error = CheckpointError(
            f"the checkpoint of epoch {self.completed}, the last, was NOT saved{who}: {first['why']}; the run "
            f"has not finished ({newest})", hint=f"{first['fix']}; then {how}")
        error.every_rank = True
        raise error

    def _train_again(self) -> str:
        """The `jobrun train` that starts this run anew, over it: its plan and overrides."""
        try:
            info = self.run_dir.info()
        except (JobrunError, OSError):
            info = None  # the command still says what it takes
        source, sets = (info.source, info.sets or []) if info is not None and info.source else ("PLAN", [])
        return hints.train_again(source, sets, self.run_dir.path, overwrite=True)

    def _agree_on_stop(self) -> None:
        """With replicas: stop here, all ranks together, when any of them was signalled
        (after the save: every rank finished it; see jobrun.signals). Rank 0 also learns
        whether another rank's save failed: only its console and metrics are the run's."""
        failed, self._failed_save = self._failed_save, None
        if self.cfg.world_size > 1:
            from jobrun.runner.group import agree_on_stop

            count, epoch = agree_on_stop(failed)
            if self.main_rank and count > (failed is not None):  # another rank's save failed too
                self._warn(f"checkpoint of epoch {epoch} was NOT saved by {count} of "
                           f"{self.cfg.world_size} ranks (each says why on stderr); a resume goes on "
                           "from the newest epoch that every rank saved")

    def _restarted(self, epoch: int | None) -> None:
        """Say where the job goes on from: a resume, or a restart (which rank died, how)."""
        restart = self.cfg.restart
        if restart is None:
            if epoch is not None:
                self.display.line(f"resumed from checkpoint epoch {epoch}")
            return
        where = f"checkpoint epoch {epoch}" if epoch is not None else "the start (no checkpoint yet)"
        who = f"rank {restart['rank']} died ({restart['how']})" if restart.get("rank") is not None \
            else restart["how"]
        self.display.line(f"restart {restart['restart']}: {who}; resumed from {where}")
        if self.main_rank:
            facts = {k: restart.get(k) for k in ("restart", "rank", "exitcode", "signal")}
            self.metrics.write({"epoch": epoch or 0, "event": "restart", **facts, "from_epoch": epoch})
            self.run_dir.record_restart({**facts, "from_epoch": epoch, "time": round(time.time(), 3)})

    def _record(self, status: str, error: JobrunError | Interrupted | None = None) -> None:
        self.status = status
        if self.main_rank and not self._unrecorded:
            self.run_dir.record_end(status, error, last_epoch=self.completed)

    def _run_group(self, name: str) -> dict[str, dict[str, Any]]:
        self.group = name
        tasks = self.groups[name]
        self.display.status(f"{name} {self.epoch}" if name == "epoch" else name)
        if self.profile is not None and tasks:
            return self.profile.run_group(name, tasks, self._run_tasks)
        if not tasks:
            return {}
        if len(tasks) == 1:
            return {tasks[0].task.name: tasks[0].run()}
        return self._run_tasks(name, tasks, lambda t: t.run())

    def _run_tasks(self, name: str, tasks: list[CompiledTask],
                   run: Any) -> dict[str, dict[str, Any]]:
        results: dict[str, dict[str, Any]] = {}

        def runner(t: CompiledTask):
            return lambda: results.__setitem__(t.task.name, run(t))

        run_concurrently([runner(t) for t in tasks], f"group {name}")
        return {t.task.name: results[t.task.name] for t in tasks}

    def _warn(self, message: str) -> None:
        self.save_failures.append(message)
        if self.main_rank:
            self.display.warn(message)
            self.metrics.write({"epoch": self.epoch, "event": "warning", "message": message})
        else:  # the console is rank 0's: another rank says what went wrong on stderr
            print(f"[rank {self.rank}] warning: {message}", file=sys.stderr, flush=True)

    def _summary(self) -> None:
        last = f", last checkpoint epoch {self._last_saved}" if self.ckpt_dir else ""
        self.display.line(f"job {self.plan.job!r} finished after epoch {self.epoch}{last}")
        for message in self.save_failures:
            self.display.warn(message)

    # -- signals ----------------------------------------------------------------------
    @contextmanager
    def _signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        owner = os.getpid()

        def handler(signum: int, frame: Any) -> None:
            if signals.in_forked_worker(owner, signum):
                return
            signals.expect_worker_deaths()
            # With replicas the ranks stop together where they agree (jobrun.signals),
            # unless none comes within its grace.
            if self.cfg.world_size > 1 and not signals.request(signum):
                return
            if self._saving or self._pending_signal is not None:
                # finish the save first (never a half checkpoint), and record its epoch
                self._pending_signal = self._pending_signal or signum
                return
            if self.status == "finished":  # as the finished job closes: it stays finished
                raise Interrupted(signum, during=signals.CLOSING)
            if self._stop is not None:  # out of the stop's close, saying how to go on
                raise self._stop
            raise Interrupted(signum)

        signals.reset()
        old = {s: signal.signal(s, handler) for s in signals.SIGNALS}  # SIGUSR1: SLURM's warning
        try:
            yield
        finally:
            signals.disarm()
            for s, h in old.items():
                signal.signal(s, h)


__all__ = ["JobConfig", "JobRunner", "Interrupted", "RunError"]
