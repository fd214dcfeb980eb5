"""The processes of a job: the worker each rank runs, and the launcher that starts them.

With ``replicas: N`` (or ``max_restarts``) on one host, the workers are started by
torch's elastic launcher (the machinery behind torchrun): it runs the rendezvous, sets
RANK/WORLD_SIZE/MASTER_* for each worker, watches them, and when one dies stops the rest.
With restarts left it starts them all again (TORCHELASTIC_RESTART_COUNT tells them), and
each resumes from the latest complete checkpoint; otherwise the launcher names the rank
that failed. Under `torchrun` (several hosts) jobrun's worker runs in the process
torchrun started, and a restart by torchrun's agent is resumed the same way.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn

from jobrun import hints, safefs, signals, store
from jobrun.errors import CheckpointError, Interrupted, JobrunError, RunError, UsageError
from jobrun.plans import ir
from jobrun.runner import forkserver, group
from jobrun.runner.devices import device_for
from jobrun.runner.pick import pick_epoch
from jobrun.runner.resuming import Resuming
from jobrun.runner.rundir import CONSOLE_FILE, RunDir

# How long a rank whose peer is gone waits for the launcher to stop it (so that the
# launcher names the rank that died, not the ones that lost it) before it reports.
PEER_LOST_WAIT_S = 5.0


@dataclass
class Launch:
    """What every worker process of a run needs to start."""

    run_dir: Path
    plan_dir: Path
    device: str  # as asked for (auto, cpu, cuda, cuda:N); each worker picks its own
    resume_epoch: int | None
    replicas: int
    max_restarts: int = 0
    resume_world: int | None = None  # the ranks that wrote resume_epoch (resume --replicas)
    force: bool = False  # resume although init built other things (job.py, _check_init)
    spawned: bool = False  # started by the elastic launcher here (not the CLI's own process)
    profile: int | None = None  # --profile: None off, 0 step times, N also a torch trace of N steps
    # The ranks that died so far, as the launcher saw them (rank, exitcode, signal, time);
    # a restarted worker reports the last one.
    deaths: list[dict[str, Any]] = field(default_factory=list)
    resuming: Resuming | None = None  # what a resume records once it restored (rank 0 writes it)
    acting: hints.Acting | None = None  # what the hints of the process that started it name
    launcher: int = 0  # the launcher's pid (spawned: a rank watches it, signals.watch_launcher)

    @property
    def verified(self) -> bool:
        """Whether resume_epoch is checksummed: a Launch with one comes from `resume`
        or a restart, which has just checked it (every rank, or this process's own)."""
        return self.resume_epoch is not None


def restart_count() -> int:
    """How often the elastic agent (ours or torchrun's) has restarted this job's ranks."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def start(launch: Launch, torchrun: bool, plan: ir.Plan) -> int:
    """Run the job in this process (one replica, or one torchrun rank) with the plan
    already compiled, or start the workers (each compiles the run's own plan)."""
    if torchrun or (launch.replicas <= 1 and launch.max_restarts == 0):
        return worker(launch, plan)
    return _elastic(replace(launch, spawned=True, acting=hints.acting(), launcher=os.getpid()))


# -- the launcher ------------------------------------------------------------------------------


def _elastic(launch: Launch) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # A failed rank's peers get 5 s to stop; torch 2.11's LaunchConfig has no such field
    # (its agent waits its own default), and `torch>=2.10` is what jobrun asks for.
    quick_stop = {"shutdown_timeout": 5} if "shutdown_timeout" in {f.name for f in fields(LaunchConfig)} else {}
    _start_resource_tracker()
    start_method = forkserver.start_method()
    # The agent's error files go to a directory of this launch, removed after it (torch's
    # default left an empty torchelastic_* tree in $TMPDIR per run).
    with tempfile.TemporaryDirectory(prefix="jobrun-elastic-", ignore_cleanup_errors=True) as logs:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=launch.replicas, run_id=uuid.uuid4().hex[:12],
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=launch.max_restarts,
            monitor_interval=0.2, start_method=start_method, logs_specs=DefaultLogsSpecs(log_dir=logs),
            **quick_stop,
        )
        try:
            with _torch_logs_to(launch.run_dir / CONSOLE_FILE) as log, _deaths_seen(launch, log), \
                    _handlers_kept(), _usr1_as_term():
                results = elastic_launch(config, worker)(launch)
        except ChildFailedError as e:
            rank, failure = _culprit(e.failures)
            code = failure.exitcode
            if code in (130, 141, 143):  # stopped: SIGINT, a closed output (SIGPIPE), SIGTERM
                return code
            if code < 0:
                detail = f"killed by signal {-code}"
            else:
                detail = failure.message if isinstance(failure.message, str) else ""
            others = sorted(r for r in e.failures if r != rank)
            stopped = f"; ranks {', '.join(map(str, others))} stopped with it" if others else ""
            tried = (f" (after {launch.max_restarts} restart{'s' * (launch.max_restarts > 1)})"
                     if launch.max_restarts else "")
            error = RunError(
                f"replica rank {rank} failed (exit code {code}){': ' + detail if detail else ''}{stopped}{tried}",
                hint=f"its messages are above and in {launch.run_dir / CONSOLE_FILE}; continue with "
                     f"`{hints.command('resume', run=launch.run_dir)}`",
            )
            # run.json keeps what the rank itself said (its error file: see _error_file).
            said = failure.message.get("message") if isinstance(failure.message, dict) else None
            from jobrun.runner.launch import to_console_log  # the console said both: the log too
            to_console_log(RunDir(launch.run_dir), [*([said] if rank and isinstance(said, str) and said else []),
                                                    error.format_message()])
            RunDir(launch.run_dir).record_end(
                "failed", RunError(said.split("\n")[0]) if isinstance(said, str) and said else error,
                keep_ended=True)
            raise error from None
        except SignalException as e:
            RunDir(launch.run_dir).record_end("interrupted", keep_ended=True)
            return 128 + int(e.sigval)
        finally:
            forkserver.stop()
        codes = [c for c in results.values() if c]
        return max(codes) if codes else 0


@contextmanager
def _torch_logs_to(path: Path) -> Iterator[Any]:
    """Send torch's own log lines (the elastic agent's warnings, a dead worker's traceback)
    to the run's log file instead of the console, where jobrun's message says what
    happened. torch gives many of its loggers their own stderr handler. Yields the log
    file's stream (None when it cannot be written)."""
    try:
        stream = os.fdopen(safefs.open_write(path, append=True), "a", buffering=1)
    except OSError:
        yield None  # no log file: the lines stay on the console
        return
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    swapped: list[tuple[logging.Logger, list[logging.Handler]]] = []
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger):
            consoles = [h for h in logger.handlers if getattr(h, "stream", None) is sys.stderr]
            if consoles:
                swapped.append((logger, logger.handlers[:]))
                logger.handlers = [h for h in logger.handlers if h not in consoles] + [handler]
    try:
        yield stream
    finally:
        for logger, handlers in swapped:
            logger.handlers = handlers
        stream.close()


class _Deaths(logging.Handler):
    """Learns which worker died and how from the exception torch's process context logs
    when it finds one dead (the agent keeps that to itself when it restarts the group):
    the launcher says so at once, and the restarted workers report it."""

    def __init__(self, launch: Launch, log: Any) -> None:
        super().__init__(logging.ERROR)
        self.launch, self.log = launch, log

    def emit(self, record: logging.LogRecord) -> None:
        from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, ProcessExitedException | ProcessRaisedException):
            return
        code = getattr(error, "exit_code", 1)
        death = {"rank": error.error_index, "exitcode": code, "time": round(time.time(), 3),
                 "signal": signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else None}
        self.launch.deaths.append(death)
        restart = len(self.launch.deaths)
        if restart <= self.launch.max_restarts:
            line = (f"rank {death['rank']} died ({describe_death(death)}); restarting every rank "
                    f"from the latest complete checkpoint (restart {restart} of {self.launch.max_restarts})")
            print(line, flush=True)
            if self.log is not None:
                self.log.write(line + "\n")


def describe_death(death: dict[str, Any] | None) -> str:
    if not death:
        return "a rank failed"
    if death.get("signal"):
        return f"killed by {death['signal']}"
    return f"exit code {death.get('exitcode')}"


def _platform_start_method() -> None:
    """Give a rank the platform's default start method (fork on Linux), as a process the
    CLI or torchrun starts has. A process the launcher spawned inherits `spawn` as its
    default, so a Dataset reader's DataLoader spawned its workers, each a new interpreter
    importing torch, every pass: an epoch of 2 replicas took 20x the time of 1."""
    import multiprocessing

    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)


def _start_resource_tracker() -> None:
    """Start Python's multiprocessing resource tracker (the spawned workers use it) with
    SIGUSR1 ignored and its warnings off. It lives in the launcher's process group and
    ignores only SIGINT and SIGTERM: SLURM's SIGUSR1 to the group (`--signal=USR1@90`)
    killed it, and it printed a Python traceback for each of the workers' semaphores; a
    launcher killed with kill -9 had it warn of "leaked semaphore objects", which it then
    cleans up itself. An ignored signal stays ignored across its exec, and it takes the
    interpreter's -W options; the launcher's own are put back at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    from multiprocessing import resource_tracker

    kept, options = signal.signal(signal.SIGUSR1, signal.SIG_IGN), list(sys.warnoptions)
    sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGUSR1, kept)
        sys.warnoptions[:] = options


@contextmanager
def _deaths_seen(launch: Launch, log: Any) -> Iterator[None]:
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    handler = _Deaths(launch, log)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _culprit(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that caused the failure: one killed by a signal (not the launcher's
    SIGTERM) before ranks that merely saw a collective break, then the earliest."""

    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, f = item
        killed = f.exitcode < 0 and f.exitcode != -signal.SIGTERM
        return (0 if killed else 1, float(getattr(f, "timestamp", 0) or 0), rank)

    return min(failures.items(), key=order)


# -- the worker --------------------------------------------------------------------------------


def worker(launch: Launch, plan: ir.Plan | None = None) -> int:
    """One process of the job (also the whole job when there is one replica). ``plan``:
    the compiled plan when this process has it; a spawned worker compiles the run's own.

    In the CLI's own process errors and signals propagate (the CLI prints them). A
    worker under a launcher prints its own message and exits: a rank interrupted with
    the others exits 128+signal (rather than returning: the elastic agent that is
    stopping its workers waits for them to exit), a rank whose collective broke because
    another rank is gone waits for the launcher to stop it.
    """
    if launch.spawned:
        hints.use(launch.acting)  # its hints name what the launching process's name
        _own_session()
        signals.watch_launcher(launch.launcher)  # its death comes as SIGINT: said as such
        # (signals.LAUNCHER_GONE)
        _platform_start_method()
    if hints.acting() is None:  # a rank torchrun started
        hints.act_on(launch.run_dir)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    alone = world == 1 and not launch.spawned
    try:
        code = _run(launch, plan, rank, world)
        if world > 1:
            group.finish()
        signals.exit_when_orphaned(code)  # torch's wrapper waits for the launcher next
        return code
    except Interrupted as e:
        if alone:
            raise  # the CLI prints it
        if rank == 0:
            print(e.format_message(), file=sys.stderr, flush=True)
        _leave(launch, e.exit_code)
    except JobrunError as e:
        if alone:
            raise
        if e.every_rank:
            # The job failed, no rank did: rank 0 says it once, and every rank ends with
            # its code as a finished job ends, so that the launcher names no rank (and
            # restarts none). torchrun's summary shows the error file.
            _error_file(e.format_message())
            if rank == 0:
                print(e.format_message(), file=sys.stderr, flush=True)
            if world > 1:
                group.finish()
            signals.exit_when_orphaned(e.exit_code)
            return e.exit_code
        if world > 1 and group.lost_peer(e):
            # Another rank failed: say what it said (on another host too), not the broken
            # connection, then let the launcher stop this one. Its signal (it saw that rank
            # die) ends this one quietly whenever it comes: the handlers first, and the
            # store's wait for a message on a thread, where it cannot hold the signal off.
            _leave_on_signal(launch)
            told = _interruptibly(group.peer_failure)
            if told is not None:
                theirs = f"[rank {told[0]}] {told[1]}"
                _error_file(theirs)  # the root cause a launcher on this host reports
                local = int(os.environ.get("LOCAL_RANK", 0))
                first = rank - local  # this host's ranks: first... (the failed one printed it there)
                if local == 0 and not first <= told[0] < first + int(os.environ.get("LOCAL_WORLD_SIZE", world)):
                    print(theirs, file=sys.stderr, flush=True)
            _await_stop(launch)
            if told is not None:  # not stopped (another host's launcher): leave, said already
                _leave(launch, e.exit_code)
            # Not told, not stopped: a rank of another host went away without a word. Its
            # broken connection (torch's text, a frame of jobrun's) is no message of ours.
            e = RunError("stopped: another rank left while this one waited for it in a collective, "
                         "without a message (killed, or its host went down)",
                         hint=f"its launcher names it; continue with `{hints.command('resume', run=launch.run_dir)}`")
        text = f"[rank {rank}] {e.format_message()}" if world > 1 else e.format_message()
        if world > 1:
            group.tell_failure(rank, e.format_message())
        _error_file(text)
        print(text, file=sys.stderr, flush=True)
        _leave(launch, e.exit_code)
    finally:
        group.stop()


def _error_file(text: str) -> None:
    """Write jobrun's message where the elastic agent (torchrun's, or our launcher's)
    looks for a failed worker's error, so that its summary shows it instead of "To
    enable traceback see ..." (torch's error-file format: its record() writes the same)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    with suppress(OSError):
        safefs.write_atomic(Path(path), json.dumps(data).encode())


@contextmanager
def _handlers_kept() -> Iterator[None]:
    """Put back the signal handlers torch's agent replaces and never restores (SIGTERM,
    SIGINT, SIGHUP, SIGQUIT): a process running more than one command got torch's
    SignalException from a later Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    kept = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:  # None: set outside Python, cannot be set back
                signal.signal(sig, handler)


@contextmanager
def _usr1_as_term() -> Iterator[None]:
    """SIGUSR1 (SLURM's warning before it stops a job) reaches the launcher alone; torch's
    agent forwards SIGTERM to the ranks, not SIGUSR1, so it becomes a SIGTERM here: the
    ranks stop together after a checkpoint and the job exits 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


def _own_session() -> None:
    """Put this spawned worker in a session of its own, as torchrun's workers are: Linux's
    autogroup scheduler schedules a session's processes as one group, and ranks sharing
    the launcher's (the terminal's) trained 10-25% slower (benchmarks' fsdp section). A
    terminal's Ctrl-C then reaches the launcher alone, which forwards it to every rank, and
    a launcher that dies still takes the ranks with it (their parent-death signal)."""
    if hasattr(os, "setsid"):
        with suppress(OSError):  # already a session or group leader: nothing to gain
            os.setsid()


def _leave(launch: Launch, code: int) -> NoReturn:
    """End this worker with ``code``. A worker the elastic launcher spawned has finished
    (its files closed): it leaves the process group and exits at once, because the
    teardown of an interpreter that imported torch takes a second or more, which a
    Ctrl-C would wait for."""
    if launch.spawned:
        group.stop()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _run(launch: Launch, plan: ir.Plan | None, rank: int, world: int) -> int:
    from jobrun.ops.loader import close_all
    from jobrun.runner.job import JobConfig, JobRunner
    from jobrun.runner.rng import seed_everything

    if launch.resuming is not None and launch.resuming.recorded(RunDir(launch.run_dir)):
        launch = replace(launch, resuming=None)  # a restarted rank: the resume is recorded
    if plan is None:
        run, sets = RunDir(launch.run_dir), launch.resuming.sets if launch.resuming else ()
        plan = run.changed_plan(sets)[0] if sets else run.plan()  # the sets are not stored yet
    # Model classes and functions next to the plan are importable by `build`/`call`.
    if str(launch.plan_dir) not in sys.path:
        sys.path.insert(0, str(launch.plan_dir))
    _set_threads()  # before anything computes: OpenMP sizes its pool at the first use
    device = device_for(launch.device, world)
    if world > 1:
        group.start(device)
    restart = restart_count()
    if restart:
        launch = _restarted(launch, plan, rank, world, restart)
    seed_everything(plan.seed)
    cfg = JobConfig(plan=plan, run_dir=launch.run_dir.resolve(), plan_dir=launch.plan_dir,
                    device=device, rank=rank, world_size=world,
                    resume_epoch=launch.resume_epoch, resume_verified=launch.verified,
                    resume_world=launch.resume_world, force=launch.force, resuming=launch.resuming,
                    restart=_restart_facts(launch, restart) if restart else None,
                    profile=launch.profile is not None, profile_torch=launch.profile or 0)
    try:
        return JobRunner(cfg).run()
    finally:  # its DataLoader workers (persistent too) stop with the job: a spawned rank's
        close_all()  # exit terminated them before atexit, and torch raised their deaths


def _restarted(launch: Launch, plan: ir.Plan, rank: int, world: int, restart: int) -> Launch:
    """The Launch of a restarted rank: it resumes from the latest complete checkpoint,
    picked as `resume` picks it (checksummed, each rank its own files, all agreeing), or
    starts again from init when there is none yet."""
    run = RunDir(launch.run_dir, plan)
    ckpt = run.checkpoints
    epoch = saved = None
    said: list[str] = []  # rank 0's skipped epochs: console.log's too, as a resume's
    if ckpt is not None:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            store.clean(ckpt)  # what the killed saves left
        gather = group.gather if world > 1 else None
        if gather:
            gather(None)  # nobody lists the checkpoints while they are cleaned
        try:
            epoch, saved = pick_epoch(ckpt, plan, world, None, change_ok=True,
                                      rank=rank if gather else None, gather=gather, said=said)
        except CheckpointError as e:
            if "no complete checkpoint" not in e.message:
                raise
    if rank == 0:
        run.truncate_metrics(-1 if epoch is None else epoch)
        from jobrun.runner.launch import to_console_log

        to_console_log(run, said)
    return replace(launch, resume_epoch=epoch, resume_world=saved)


def _restart_facts(launch: Launch, restart: int) -> dict[str, Any]:
    death = launch.deaths[restart - 1] if len(launch.deaths) >= restart else {}
    return {"restart": restart, "rank": death.get("rank"), "exitcode": death.get("exitcode"),
            "signal": death.get("signal"), "from_epoch": launch.resume_epoch,
            "how": describe_death(death) if death else "a rank failed"}


def _leave_on_signal(launch: Launch) -> None:
    """From now on a signal ends this rank quietly (the launcher stopping it); one that
    came already ends it now."""
    if signals.requested():
        _leave(launch, 128 + signals.requested())

    def leave(signum: int, frame: Any) -> None:
        _leave(launch, 128 + signum)

    for s in signals.SIGNALS:
        signal.signal(s, leave)


def _interruptibly(fn: Any) -> Any:
    """fn() on a thread of its own, waited for by this one, where a signal's handler runs
    at once (one that came during a wait in C++, as a store's, ran only after it)."""
    box: list[Any] = [None]
    thread = threading.Thread(target=lambda: box.__setitem__(0, fn()), daemon=True)
    thread.start()
    thread.join()
    return box[0]


def _await_stop(launch: Launch) -> None:
    """Wait (a while) for the launcher to stop this rank, which ends it quietly."""
    _leave_on_signal(launch)
    time.sleep(PEER_LOST_WAIT_S)


def _set_threads() -> None:
    """torch's CPU thread count in this process: JOBRUN_THREADS=N pins it; else, with
    several ranks on this host and no OMP_NUM_THREADS, each rank takes its share of the
    CPUs it may use (at least one), as torchrun's OMP_NUM_THREADS=1 does for its ranks.

    torch's own default is every CPU in every rank: 2 ranks on 2 CPUs then trained the
    fsdp benchmark's MLP 1.2-1.4x slower, each rank's idle OpenMP thread spinning on the core
    the other rank computed on. Float results depend on the count (reductions split
    differently): a resume is bit-exact with the same count, which the same host and the
    same number of replicas give."""
    threads = os.environ.get("JOBRUN_THREADS")
    if threads:
        try:
            count = int(threads)
        except ValueError:
            raise UsageError(f"JOBRUN_THREADS={threads!r} is not a number",
                             hint="set it to the number of CPU threads torch may use") from None
    else:
        try:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            local = 1
        if local <= 1 or os.environ.get("OMP_NUM_THREADS"):
            return  # torch's default (which follows OMP_NUM_THREADS)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        count = cpus // local
    import torch

    torch.set_num_threads(max(1, count))
