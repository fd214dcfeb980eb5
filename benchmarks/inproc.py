"""Run a plan in this process through the runner (`JobRunner`), timing its epochs.

The runner is built as `jobrun train` builds it (compile, seed, JobConfig, JobRunner),
with a Display that keeps every epoch's times instead of printing them: the runner's own
wall-clock measure (``EpochResult.seconds``: the epoch group and the stop check) and the
CPU time of the process over the same span (plus the checkpoint save, when the plan has
one). Start-up (imports, init, data) is never counted.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass
class Epoch:
    seconds: float  # the runner's own measure (wall clock, the epoch group only)
    cpu: float  # CPU time of this process from the start of the epoch group to its end
    wall: float  # wall clock over the same span (the checkpoint save included)
    ckpt: str  # the epoch line's checkpoint note ("ckpt 12 MB in 30 ms", "... async")
    outputs: dict[str, Any] | None = None  # the epoch's outputs, unrounded (metrics.jsonl rounds)


class _Capture:
    """Stands in for jobrun.runner.display.Display: silent, keeps every epoch's times.

    The runner calls ``status("epoch N")`` as the epoch group starts and ``epoch_line``
    once it ended (and after its checkpoint, if any): the CPU time between the two is
    the epoch's. ``between`` is called after each epoch, outside both measures.
    """

    def __init__(self, between: Callable[[int], None] | None = None) -> None:
        from jobrun.runner.display import Display

        self._inner = Display(enabled=False, tty=False)
        self.epochs: list[Epoch] = []
        self._cpu0 = 0.0
        self._wall0 = 0.0
        self._between = between

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def status(self, what: str) -> None:
        if what.startswith("epoch "):
            self._cpu0 = time.process_time()
            self._wall0 = time.perf_counter()

    def epoch_line(self, result: Any, max_epochs: int | None, max_steps: int | None = None) -> None:
        cpu = time.process_time() - self._cpu0
        wall = time.perf_counter() - self._wall0
        self.epochs.append(Epoch(result.seconds, cpu, wall, getattr(result, "ckpt", "") or "",
                                 getattr(result, "outputs", None)))
        if self._between is not None:
            self._between(result.epoch)


def write_plan(plan: dict[str, Any], directory: Path, name: str = "plan.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def run_plan(
    plan_path: Path, run_dir: Path | None = None, between: Callable[[int], None] | None = None,
    rank: int = 0, world_size: int = 1, device: str = "cpu", profile: bool = False,
) -> list[Epoch]:
    """Run the job; the times of each epoch, in order. ``between(epoch)`` runs after each
    epoch, outside its times (to interleave a baseline with the epochs).

    With ``world_size > 1`` this is one rank of a data-parallel job: the caller has joined
    the process group (`jobrun.runner.group.start`), and every rank passes the same
    ``run_dir``, whose run.json rank 0 writes."""
    from jobrun.plans.compile import compile_file
    from jobrun.runner.job import JobConfig, JobRunner
    from jobrun.runner.rng import seed_everything
    from jobrun.runner.rundir import RunDir

    own = run_dir is None
    assert world_size == 1 or not own, "the ranks of a job share its run_dir"
    tmp = tempfile.TemporaryDirectory(prefix="jobrun-bench-") if own else None
    rdir = Path(tmp.name) if tmp else run_dir
    assert rdir is not None
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        plan = compile_file(plan_path, run_dir=str(rdir), plan_dir=str(plan_path.parent))
        if rank == 0:
            RunDir(rdir).write_info({
                "job": plan.job, "plan_dir": str(plan_path.parent), "status": "running",
                "started": time.time(), "replicas": world_size, "device": device,
            })
        if world_size > 1:
            import torch.distributed

            torch.distributed.barrier()  # run.json is there for every rank
        seed_everything(plan.seed)
        display = _Capture(between)
        cfg = JobConfig(plan=plan, run_dir=rdir, plan_dir=plan_path.parent, device=device, rank=rank,
                        world_size=world_size, profile=profile)
        code = JobRunner(cfg, display=display).run()  # type: ignore[arg-type]
        if code != 0:
            raise RuntimeError(f"job {plan.job} exited with {code}")
        return display.epochs
    finally:
        if tmp is not None:
            tmp.cleanup()


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
