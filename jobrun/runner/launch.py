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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from jobrun import __version__
from jobrun.errors import CheckpointError, JobrunError, PlanError, RunError, UsageError
from jobrun.plans import ir
from jobrun.plans.compile import compile_tree
from jobrun.plans.load import load_file, to_plain
from jobrun.plans.resolve import apply_sets
from jobrun.runner import rundir as rd


@dataclass
class Launch:
    run_dir: Path
    resume_epoch: int | None
    replicas: int

    @property
    def verified(self) -> bool:
        """Whether resume_epoch is checksummed: a Launch with one comes from `resume`,
        which has just checked it (every rank, or under torchrun this process's own)."""
        return self.resume_epoch is not None


# -- entry points (called by the CLI) -------------------------------------------------------


def train(plan_path: str, run_dir: str | None, sets: tuple[str, ...], replicas: int | None,
          device: str | None) -> int:
    torchrun = _under_torchrun()
    plan, stored = _compile_for_run(plan_path, sets, run_dir)
    path = Path(run_dir) if run_dir else Path("runs") / plan.job
    n = _replicas(plan, replicas)
    if torchrun:
        # Every rank joins first; rank 0 prepares the run directory while the others wait.
        import torch.distributed as dist

        _init_process_group(_device(device or plan.device, int(os.environ["WORLD_SIZE"])))
        if int(os.environ["RANK"]) != 0:
            dist.barrier()
            return _worker(str(path), None)
    _refuse_used(path)
    path.mkdir(parents=True, exist_ok=True)
    lock = rd.RunLock(path)
    lock.acquire()
    try:
        _refuse_used(path)
        (path / rd.PLAN_FILE).write_text(yaml.safe_dump(stored, sort_keys=False))
        src = Path(plan_path)
        rd.write_json_atomic(path / rd.RUN_FILE, {
            "job": plan.job, "source": str(src.resolve()), "plan_dir": str(src.resolve().parent),
            "plan_sha256": hashlib.sha256(src.read_bytes()).hexdigest(), "sets": list(sets),
            "replicas": n, "device": device or plan.device, "started": time.time(),
            "status": "running", "jobrun": __version__,
        })
        metrics = path / rd.METRICS_FILE
        if metrics.exists():
            metrics.unlink()  # a run without checkpoints being started again from scratch
        if torchrun:
            import torch.distributed as dist

            dist.barrier()
        return _launch(Launch(path, None, n), torchrun)
    finally:
        lock.release()


def resume(run_dir: str | None, epoch: int | None) -> int:
    path = Path(run_dir) if run_dir else rd.latest_run()
    info = rd.read_run_info(path)
    torchrun = _under_torchrun()
    # Under torchrun every rank picks the same epoch from disk; rank 0 alone holds the
    # lock and writes the run's files.
    leader = not torchrun or int(os.environ["RANK"]) == 0
    lock = rd.RunLock(path)
    if leader:
        lock.acquire()
    try:
        plan = _plan_from_run(path, info)
        if plan.checkpoint is None:
            raise UsageError(f"the job in {path} writes no checkpoints, so it cannot be resumed",
                             hint="add a `checkpoint:` block to the plan and train again")
        ckpt_dir = _ckpt_dir(path, plan)
        n = int(os.environ["WORLD_SIZE"]) if torchrun else int(info.get("replicas", 1))
        if epoch is None and info.get("status") == "finished":
            print(f"{path}: job {plan.job!r} already finished at epoch {info.get('last_epoch')}; "
                  "nothing to do (use --epoch E to train again from E)")
            return 0
        if torchrun:
            # Every process checksums its own rank only; they agree on the epoch together.
            _init_process_group(_device(info.get("device") or plan.device, n))
            epoch = _pick_epoch(ckpt_dir, plan, n, epoch, int(os.environ["RANK"]), _all_gather)
        else:
            epoch = _pick_epoch(ckpt_dir, plan, n, epoch)
        if leader:
            rd.truncate_metrics(path / rd.METRICS_FILE, epoch)
            rd.update_run_info(path, status="running", resumed_from=epoch, started=time.time())
        return _launch(Launch(path, epoch, n), torchrun)
    finally:
        lock.release()


# -- plans and run directories ------------------------------------------------------------


def _compile_for_run(plan_path: str, sets: tuple[str, ...], run_dir: str | None):
    from jobrun.plans.analyze import analyze

    tree = load_file(plan_path)
    apply_sets(tree, sets)
    stored = to_plain(tree)
    job = tree.get("job")
    rdir = Path(run_dir) if run_dir else Path("runs") / str(job)
    plan = compile_tree(tree, plan_path, (), run_dir=str(rdir.resolve()),
                        plan_dir=str(Path(plan_path).resolve().parent))
    errors = [d for d in analyze(plan) if d.severity == "error"]
    if errors:
        first = errors[0]
        more = "\n".join(d.format() for d in errors[1:])
        raise PlanError(first.message + (f"\n{more}" if more else ""), first.pos,
                        first.hint or "`jobrun analyze PLAN` lists every problem")
    return plan, stored


def _plan_from_run(path: Path, info: dict[str, Any]) -> ir.Plan:
    """The plan a run uses: the user's file when unchanged (so errors point there), else
    the resolved copy stored in the run directory."""
    plan_dir = info.get("plan_dir", str(path.resolve()))
    source = Path(info.get("source", ""))
    try:
        same = source.is_file() and hashlib.sha256(source.read_bytes()).hexdigest() == info.get("plan_sha256")
    except OSError:
        same = False
    if same:
        tree, name, sets = load_file(source), str(source), info.get("sets", [])
    else:
        tree, name, sets = load_file(path / rd.PLAN_FILE), str(path / rd.PLAN_FILE), []
    return compile_tree(tree, name, sets, run_dir=str(path.resolve()), plan_dir=plan_dir)


def _ckpt_dir(run_dir: Path, plan: ir.Plan) -> Path:
    assert plan.checkpoint is not None
    p = Path(plan.checkpoint.dir).expanduser()
    return p if p.is_absolute() else run_dir / p


def _refuse_used(path: Path) -> None:
    info_file = path / rd.RUN_FILE
    if not info_file.exists():
        return
    try:
        info = rd.read_run_info(path)
        plan = _plan_from_run(path, info)
    except JobrunError:
        return
    if plan.checkpoint is None:
        return
    from jobrun import store

    ckpt_dir = _ckpt_dir(path, plan)
    if ckpt_dir.is_dir() and store.list_checkpoints(ckpt_dir):
        raise UsageError(
            f"run directory {path} already holds checkpoints",
            hint=f"continue it with `jobrun resume --run-dir {path}`, or choose another --run-dir",
        )


def _pick_epoch(ckpt_dir: Path, plan: ir.Plan, replicas: int, epoch: int | None,
                rank: int | None = None, gather: Callable[[Any], list[Any]] | None = None) -> int:
    """The epoch to resume from, checksummed: ``epoch``, or else the newest one whose every
    node and rank is complete and intact (each newer one skipped with a warning).

    ``rank`` None: this process checks every rank. Under torchrun each process checks only
    its own ``rank``, and ``gather`` (an all-gather over the processes) shares what each
    found, so that all skip, pick or refuse the same epoch: each byte is read once, by the
    rank it belongs to. The cheap checks (COMMIT, manifests, sizes) agree by themselves.
    """
    from jobrun import store

    nodes = list(plan.nodes)
    say = rank in (None, 0)

    def problems(e: int) -> tuple[str, list[str]] | None:
        """The first node with problems at epoch ``e`` and its problems (of every rank)."""
        mine = {node: store.verify(ckpt_dir, node, e, rank=rank) for node in nodes}
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


def _launch(launch: Launch, torchrun: bool) -> int:
    if launch.replicas <= 1 or torchrun:
        return _worker(str(launch.run_dir), launch.resume_epoch, launch.verified)
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
        results = elastic_launch(config, _worker)(str(launch.run_dir), launch.resume_epoch,
                                                  launch.verified)
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
        raise RunError(
            f"replica rank {rank} failed (exit code {code}){': ' + detail if detail else ''}{stopped}",
            hint=f"see the messages above; continue with `jobrun resume --run-dir {launch.run_dir}`",
        ) from None
    except SignalException as e:
        return 128 + int(e.sigval)
    codes = [c for c in results.values() if c]
    return max(codes) if codes else 0


def _culprit(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that caused the failure: one killed by a signal (not the launcher's
    SIGTERM) before ranks that merely saw a collective break, then the earliest."""

    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, f = item
        killed = f.exitcode < 0 and f.exitcode != -signal.SIGTERM
        return (0 if killed else 1, float(getattr(f, "timestamp", 0) or 0), rank)

    return min(failures.items(), key=order)


def _worker(run_dir: str, resume_epoch: int | None, verified: bool = False) -> int:
    """One process of the job (also the whole job when there is one replica).

    ``verified``: this command has checksummed ``resume_epoch`` (every rank, or under
    torchrun this process's own), so the restore skips the checksums (it still checks
    COMMIT, the manifest and the sizes).
    """
    from jobrun.runner.job import Interrupted, JobConfig, JobRunner, seed_everything

    path = Path(run_dir)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        info = rd.read_run_info(path)
        plan = _plan_from_run(path, info)
        # Model classes and functions next to the plan are importable by `build`/`call`.
        if info["plan_dir"] not in sys.path:
            sys.path.insert(0, info["plan_dir"])
        device = _device(info.get("device") or plan.device, world)
        if world > 1:
            _init_process_group(device)
        seed_everything(plan.seed)
        _set_threads()
        cfg = JobConfig(plan=plan, run_dir=path.resolve(), plan_dir=Path(info["plan_dir"]),
                        device=device, rank=rank, world_size=world, resume_epoch=resume_epoch,
                        resume_verified=verified)
        return JobRunner(cfg).run()
    except Interrupted as e:
        if rank == 0:
            print(e.format_message(), flush=True)
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


def _device(wanted: str, world: int) -> str:
    import torch

    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"device {wanted!r} was asked for, but CUDA is not available here",
                             hint="use --device cpu")
        if world > 1 and wanted == "cuda":
            wanted = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
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
