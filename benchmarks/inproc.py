"""Run a plan in this process through the runner (`JobRunner`), timing its epochs.

The runner is built as `jobrun train` builds it (compile, seed, JobConfig, JobRunner),
with a Display that keeps every epoch's result instead of printing it. An epoch's time is
the runner's own measure (``EpochResult.seconds``: the epoch group and the stop check,
without checkpoint saves), so start-up (imports, init, data) is never counted.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


class _Capture:
    """Stands in for jobrun.runner.display.Display: silent, keeps the epoch results."""

    def __init__(self) -> None:
        from jobrun.runner.display import Display

        self._inner = Display(enabled=False, tty=False)
        self.epochs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def epoch_line(self, result: Any, max_epochs: int | None) -> None:
        self.epochs.append(result)


def write_plan(plan: dict[str, Any], directory: Path, name: str = "plan.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def run_plan(plan_path: Path, run_dir: Path | None = None) -> list[float]:
    """Run the job; the seconds of each epoch, in order."""
    from jobrun.plans.compile import compile_file
    from jobrun.runner import rundir as rd
    from jobrun.runner.job import JobConfig, JobRunner, seed_everything

    own = run_dir is None
    tmp = tempfile.TemporaryDirectory(prefix="jobrun-bench-") if own else None
    rdir = Path(tmp.name) if tmp else run_dir
    assert rdir is not None
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        plan = compile_file(plan_path, run_dir=str(rdir), plan_dir=str(plan_path.parent))
        rd.write_json_atomic(rdir / rd.RUN_FILE, {
            "job": plan.job, "plan_dir": str(plan_path.parent), "status": "running",
            "started": time.time(), "replicas": 1, "device": "cpu",
        })
        seed_everything(plan.seed)
        display = _Capture()
        cfg = JobConfig(plan=plan, run_dir=rdir, plan_dir=plan_path.parent, device="cpu")
        code = JobRunner(cfg, display=display).run()  # type: ignore[arg-type]
        if code != 0:
            raise RuntimeError(f"job {plan.job} exited with {code}")
        return [r.seconds for r in display.epochs]
    finally:
        if tmp is not None:
            tmp.cleanup()


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
