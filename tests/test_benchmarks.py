"""The benchmarks run: `python benchmarks/run.py --smoke` finishes and reports every
section as numbers (no timing is asserted: the figures are benchmarks/README.md's job)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("runner", "dispatch", "plans", "checkpoint", "memory", "startup")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory probes read /proc")
def test_smoke_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "smoke"
    assert {"python", "torch", "cpus"} <= set(data["machine"])
    assert set(data["sections"]) == set(SECTIONS)
    for name in SECTIONS:
        section = data["sections"][name]
        assert "error" not in section, section.get("error")
        assert section["rows"], f"section {name} has no figures"
        for row in section["rows"]:
            for key in ("value", "ratio"):
                assert isinstance(row[key], int | float) and math.isfinite(row[key]), (name, row)
            assert row["baseline_name"] and row["goal"]
            assert row["ok"] in (True, False, None)
    # the table is printed too
    assert "PASS" in p.stdout or "MISS" in p.stdout
