"""Starting jobs: `jobrun train` and `jobrun resume`, on one process or N replicas.

With `replicas: N` on one host, the workers are started by torch's elastic launcher (the
machinery behind torchrun): it runs the rendezvous, sets RANK/WORLD_SIZE/MASTER_* for
each worker, watches them, and when one dies stops the rest and names the failed rank.
Under `torchrun` (several hosts) jobrun uses the environment it is given.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from jobrun import __version__, safefs, store
from jobrun.errors import CheckpointError, JobrunError, PlanError, RunError, UsageError
from jobrun.plans import ir
from jobrun.plans.compile import compile_tree
from jobrun.plans.load import load_file, to_plain
from jobrun.plans.overrides import apply_sets
from jobrun.runner import rng
from jobrun.runner.rundir import CONSOLE_FILE, RunDir


@dataclass
class Launch:
    """What every worker process of a run needs to start."""

    run_dir: Path
    plan_dir: Path
    device: str  # as asked for (auto, cpu, cuda, cuda:N); each worker picks its own
    resume_epoch: int | None
    replicas: int
    force: bool = False  # resume although init built other things (job.py, _check_init)

    @property
    def verified(self) -> bool:
        """Whether resume_epoch is checksummed: a Launch with one comes from `resume`,
        which has just checked it (every rank, or under torchrun this process's own)."""
        return self.resume_epoch is not None


# -- entry points (called by the CLI) -------------------------------------------------------


def train(plan_path: str, run_dir: str | None, sets: tuple[str, ...], replicas: int | None,
          device: str | None, overwrite: bool = False) -> int:
    torchrun = _under_torchrun()
    plan, stored = _compile_for_run(plan_path, sets, run_dir)
    run = RunDir(Path(run_dir) if run_dir else Path("runs") / plan.job, plan)
    n = _replicas(plan, replicas)
    src = Path(plan_path).resolve()
    launch = Launch(run.path, src.parent, device or plan.device, None, n)
    if torchrun:
        # Every rank joins first; rank 0 prepares the run directory while the others wait.
        import torch.distributed as dist

        _init_process_group(_device(launch.device, int(os.environ["WORLD_SIZE"])))
        if int(os.environ["RANK"]) != 0:
            dist.barrier()
            return _worker(launch, plan)
    else:
        _device(launch.device, 1, select=False)  # refuse a device now, before writing anything
    run.check_can_train(run.checkpoints, overwrite)
    run.create()
    with run.lock():
        run.check_can_train(run.checkpoints, overwrite)
        if overwrite:
            run.clear()
        run.start(yaml.safe_dump(stored, sort_keys=False), {
            "job": plan.job, "source": str(src), "plan_dir": str(src.parent),
            "plan_sha256": hashlib.sha256(src.read_bytes()).hexdigest(), "sets": list(sets),
            "replicas": n, "device": launch.device, "started": time.time(),
            "status": "running", "jobrun": __version__,
        })
        if torchrun:
            import torch.distributed as dist

            dist.barrier()
        return _launch(launch, torchrun, plan)


def resume(run_dir: str | None, epoch: int | str | None, sets: tuple[str, ...] = (),
           force: bool = False) -> int:
    run = RunDir(Path(run_dir)) if run_dir else RunDir.latest()
    info = run.info()
    torchrun = _under_torchrun()
    # Under torchrun every rank picks the same epoch from disk; rank 0 alone holds the
    # lock and writes the run's files.
    leader = not torchrun or int(os.environ["RANK"]) == 0
    with run.lock() if leader else nullcontext():
        if run.source_changed() and leader:
            print(f"warning: {info.get('source')} changed since the run started; resume uses the "
                  f"plan stored in {run.plan_file} (give changes as KEY=VALUE overrides)",
                  file=sys.stderr)
        changes: list[str] = []
        if sets:
            plan, changes, stored = run.changed_plan(sets)
            _refuse_errors(plan)
        else:
            plan = run.plan()
        ckpt_dir = run.checkpoints
        if ckpt_dir is None:
            raise UsageError(f"the job in {run.path} writes no checkpoints, so it cannot be resumed",
                             hint="add a `checkpoint:` block to the plan and train again")
        n = int(os.environ["WORLD_SIZE"]) if torchrun else int(info.get("replicas", 1))
        if epoch == "best":  # every process of a torchrun job reads the same manifests
            from jobrun.runner.monitor import best_epoch

            epoch = best_epoch(store.list_checkpoints(ckpt_dir), list(plan.nodes), plan, str(run.path))
        if epoch is None and info.get("status") == "finished" and not changes:
            print(f"{run.path}: job {plan.job!r} already finished at epoch {info.get('last_epoch')}; "
                  "nothing to do (use --epoch E to train again from E)")
            return 0
        device = str(info.get("device") or plan.device)
        if leader:
            store.clean(ckpt_dir)  # what a kill during a save or prune left behind
        if torchrun:
            # Every process checksums its own rank only; they agree on the epoch together.
            _init_process_group(_device(device, n))
            epoch = _pick_epoch(ckpt_dir, plan, n, epoch, int(os.environ["RANK"]), _all_gather)
        else:
            _device(device, 1, select=False)
            epoch = _pick_epoch(ckpt_dir, plan, n, epoch)
        if leader:
            run.truncate_metrics(epoch)
            facts: dict[str, Any] = {}
            if changes:
                _warn_changes(changes)
                run.write_plan(yaml.safe_dump(stored, sort_keys=False))
                facts = {"sets": [*info.get("sets", []), *sets],
                         "changes": [*info.get("changes", []), {"from_epoch": epoch, "sets": list(sets),
                                                                 "changed": changes}]}
            run.update_info(status="running", resumed_from=epoch, started=time.time(), error=None,
                            error_at=None, **facts)
        # A plan changed on purpose may make init build other things: warned, not refused.
        force = force or _beyond_extending(changes)
        return _launch(Launch(run.path, run.plan_dir, device, epoch, n, force), torchrun, plan)


# -- plans ----------------------------------------------------------------------------------


def _compile_for_run(plan_path: str, sets: tuple[str, ...], run_dir: str | None):
    tree = load_file(plan_path)
    apply_sets(tree, sets)
    stored = to_plain(tree)
    job = tree.get("job")
    rdir = Path(run_dir) if run_dir else Path("runs") / str(job)
    plan = compile_tree(tree, plan_path, (), run_dir=str(rdir.resolve()),
                        plan_dir=str(Path(plan_path).resolve().parent))
    _refuse_errors(plan)
    return plan, stored


def _refuse_errors(plan: ir.Plan) -> None:
    """A plan the analyzer finds errors in does not run: they are the message."""
    from jobrun.plans.analyze import analyze

    errors = [d for d in analyze(plan) if d.severity == "error"]
    if errors:
        first = errors[0]
        more = "\n".join(d.format() for d in errors[1:])
        raise PlanError(first.message + (f"\n{more}" if more else ""), first.pos,
                        first.hint or "`jobrun analyze PLAN` lists every problem")


# Keys a resume may change and still give the result of an uninterrupted run with them.
_EXTENDING = ("max_epochs",)


def _beyond_extending(changes: list[str]) -> bool:
    return any(not c.startswith(tuple(f"{k}:" for k in _EXTENDING)) for c in changes)


def _warn_changes(changes: list[str]) -> None:
    for change in changes:
        print(f"resuming with {change}", file=sys.stderr)
    if _beyond_extending(changes):
        print("warning: the plan changed beyond max_epochs: the result is no longer the one an "
              "uninterrupted run would give (the changes are recorded in run.json); objects init "
              "builds and the checkpoint restores (a model, an optimizer's lr, a scheduler) keep "
              "their saved state", file=sys.stderr)


def _pick_epoch(ckpt_dir: Path, plan: ir.Plan, replicas: int, epoch: int | None,
                rank: int | None = None, gather: Callable[[Any], list[Any]] | None = None) -> int:
    """The epoch to resume from, checksummed: ``epoch``, or else the newest one whose every
    node and rank is complete and intact (each newer one skipped with a warning).

    ``rank`` None: this process checks every rank. Under torchrun each process checks only
    its own ``rank``, and ``gather`` (an all-gather over the processes) shares what each
    found, so that all skip, pick or refuse the same epoch: each byte is read once, by the
    rank it belongs to. The cheap checks (COMMIT, manifests, sizes) agree by themselves.
    """
    nodes = list(plan.nodes)
    say = rank in (None, 0)

    def problems(e: int) -> tuple[str, list[str]] | None:
        """The first node with problems at epoch ``e`` and its problems (of every rank)."""
        mine = {node: store.verify(ckpt_dir, node, e, rank=rank, decode=False)
                or rng.saved_problems(ckpt_dir, node, e, _ranks(ckpt_dir, node, e, rank))
                for node in nodes}
        every = gather(mine) if gather else [mine]
        for node in nodes:
            found = [p for theirs in every for p in theirs[node]]
            if found:
                return node, found
        return None

    if epoch is not None:
        bad = problems(epoch)
        if bad:
            epochs = [info.epoch for info in store.list_checkpoints(ckpt_dir)]
            raise CheckpointError(f"checkpoint epoch {epoch} cannot be used: {bad[1][0]}",
                                  hint=f"epochs present: {', '.join(map(str, epochs)) or 'none'}")
        return epoch
    before = None
    while True:
        latest, skipped = store.latest_complete_epoch(ckpt_dir, nodes, replicas,
                                                      verify_hashes=False, before=before)
        for e, why in skipped if say else ():
            print(f"warning: skipping checkpoint epoch {e}: {why}")
        if latest is None:
            raise CheckpointError(f"no complete checkpoint in {ckpt_dir}",
                                  hint="train again with `jobrun train`")
        bad = problems(latest)
        if bad is None:
            return latest
        if say:
            print(f"warning: skipping checkpoint epoch {latest}: node {bad[0]!r}: {'; '.join(bad[1])}")
        before = latest


def _ranks(ckpt_dir: Path, node: str, epoch: int, rank: int | None) -> list[int]:
    """The ranks of a verified epoch this process checks: its own, or all it was saved by."""
    if rank is not None:
        return [rank]
    return list(range(store.read_manifest(ckpt_dir, node, epoch)["world_size"]))


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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


# -- processes ------------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _launch(launch: Launch, torchrun: bool, plan: ir.Plan) -> int:
    """Run the job in this process (one replica, or one torchrun rank) with the plan
    already compiled, or start N workers that each compile it from the run directory."""
    if launch.replicas <= 1 or torchrun:
        return _worker(launch, plan)
    return _elastic(launch)


def _elastic(launch: Launch) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=launch.replicas, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        monitor_interval=0.2, start_method="spawn", shutdown_timeout=5,
    )
    try:
        with _torch_logs_to(launch.run_dir / CONSOLE_FILE):
            results = elastic_launch(config, _worker)(launch)
    except ChildFailedError as e:
        rank, failure = _culprit(e.failures)
        code = failure.exitcode
        if code in (130, 143):
            return code
        if code < 0:
            detail = f"killed by signal {-code}"
        else:
            detail = failure.message if isinstance(failure.message, str) else ""
        others = sorted(r for r in e.failures if r != rank)
        stopped = f"; ranks {', '.join(map(str, others))} stopped with it" if others else ""
        error = RunError(
            f"replica rank {rank} failed (exit code {code}){': ' + detail if detail else ''}{stopped}",
            hint=f"its messages are above and in {launch.run_dir / CONSOLE_FILE}; continue with "
                 f"`jobrun resume --run-dir {launch.run_dir}`",
        )
        RunDir(launch.run_dir).record_end("failed", error, keep_ended=True)
        raise error from None
    except SignalException as e:
        RunDir(launch.run_dir).record_end("interrupted", keep_ended=True)
        return 128 + int(e.sigval)
    codes = [c for c in results.values() if c]
    return max(codes) if codes else 0


@contextmanager
def _torch_logs_to(path: Path) -> Iterator[None]:
    """Send torch's own log lines (the elastic agent's warnings, a dead worker's traceback)
    to the run's log file instead of the console, where jobrun's message says what
    happened. torch gives many of its loggers their own stderr handler."""
    import logging

    try:
        stream = os.fdopen(safefs.open_write(path, append=True), "a", buffering=1)
    except OSError:
        yield  # no log file: the lines stay on the console
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
        yield
    finally:
        for logger, handlers in swapped:
            logger.handlers = handlers
        stream.close()


def _culprit(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that caused the failure: one killed by a signal (not the launcher's
    SIGTERM) before ranks that merely saw a collective break, then the earliest."""

    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, f = item
        killed = f.exitcode < 0 and f.exitcode != -signal.SIGTERM
        return (0 if killed else 1, float(getattr(f, "timestamp", 0) or 0), rank)

    return min(failures.items(), key=order)


def _worker(launch: Launch, plan: ir.Plan | None = None) -> int:
    """One process of the job (also the whole job when there is one replica). ``plan``:
    the compiled plan when this process has it; a spawned worker compiles the run's own.

    ``launch.verified``: the launcher has checksummed the resume epoch (every rank, or
    under torchrun this process's own), so the restore skips the checksums (it still
    checks COMMIT, the manifest and the sizes).
    """
    from jobrun.runner.job import Interrupted, JobConfig, JobRunner, seed_everything

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        if plan is None:
            plan = RunDir(launch.run_dir).plan()
        # Model classes and functions next to the plan are importable by `build`/`call`.
        if str(launch.plan_dir) not in sys.path:
            sys.path.insert(0, str(launch.plan_dir))
        device = _device(launch.device, world)
        if world > 1:
            _init_process_group(device)
        seed_everything(plan.seed)
        _set_threads()
        cfg = JobConfig(plan=plan, run_dir=launch.run_dir.resolve(), plan_dir=launch.plan_dir,
                        device=device, rank=rank, world_size=world,
                        resume_epoch=launch.resume_epoch, resume_verified=launch.verified,
                        force=launch.force)
        return JobRunner(cfg).run()
    except Interrupted as e:
        if world == 1:
            raise  # the CLI prints it
        if rank == 0:
            print(e.format_message(), file=sys.stderr, flush=True)
        return e.exit_code
    except JobrunError as e:
        if world > 1:
            # Under the launcher, print here (with the rank) and exit non-zero.
            print(f"[rank {rank}] {e.format_message()}", file=sys.stderr, flush=True)
            raise SystemExit(e.exit_code) from None
        raise
    finally:
        _destroy_process_group()


def _set_threads() -> None:
    # Float results depend on the thread count (reductions split differently): a resume
    # is bit-exact on the same machine with the same count; JOBRUN_THREADS pins it.
    threads = os.environ.get("JOBRUN_THREADS")
    if threads:
        import torch

        try:
            torch.set_num_threads(max(1, int(threads)))
        except ValueError:
            raise UsageError(f"JOBRUN_THREADS={threads!r} is not a number",
                             hint="set it to the number of CPU threads torch may use") from None


def _device(wanted: str, world: int, select: bool = True) -> str:
    """The device this process uses; an unusable one is refused. ``select``: make it
    the current CUDA device (a worker), or only check it (before anything is written)."""
    if not select and not wanted.startswith("cuda"):
        return wanted  # cpu and auto are always usable: no need to import torch yet
    import torch

    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"device {wanted!r} was asked for, but CUDA is not available here",
                             hint="use --device cpu")
        count = torch.cuda.device_count()
        if ":" in wanted and int(wanted.split(":")[1]) >= count:
            raise UsageError(f"device {wanted!r} was asked for, but this machine has {count} "
                             "CUDA device(s)", hint=f"use cuda:0 .. cuda:{count - 1}, or cpu")
        if world > 1 and wanted == "cuda":
            wanted = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        if select:
            torch.cuda.set_device(torch.device(wanted))
    return wanted


def _init_process_group(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=float(os.environ.get("JOBRUN_DIST_TIMEOUT", "300")))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend, timeout=timeout)


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - shutting down anyway
        pass
