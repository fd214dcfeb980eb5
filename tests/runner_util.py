"""Helpers for runner tests: run the CLI in-process or as a subprocess, read results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

from jobrun.cli import main


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def jobrun(*args: str) -> Result:
    """Run `jobrun ARGS` in this process (fast: torch is imported once per session)."""
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


# A guard against a hung test, never a verdict: on a loaded machine anything may take
# minutes (JOBRUN_TEST_HANG_S changes it).
HANG_S = float(os.environ.get("JOBRUN_TEST_HANG_S", 3600))


def jobrun_proc(*args: str, cwd: Path | None = None, timeout: float = HANG_S) -> Result:
    p = subprocess.run(
        [sys.executable, "-m", "jobrun", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return Result(p.returncode, p.stdout, p.stderr)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged(run_dir: Path, msg: str | None = None) -> list[dict]:
    """The `values` of every log record (optionally only those with this msg)."""
    return [
        {**r["values"], "_epoch": r["epoch"], "_task": r["task"]}
        for r in metrics(run_dir)
        if "values" in r and (msg is None or r.get("msg") == msg)
    ]


def close(a, b, tol: float) -> bool:
    """Numbers (or nested lists of them) equal to a relative tolerance (absolute below 1)."""
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol * max(1.0, abs(a))


def ckpt_values(run_dir: Path, epoch: int, node: str = "local") -> dict:
    r = jobrun("ckpt", "show", run_dir, "--epoch", str(epoch), "--node", node, "--json")
    assert r.code == 0, r.text
    return json.loads(r.out)["nodes"][node]
