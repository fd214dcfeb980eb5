"""Ops from other packages, through the `jobrun.ops` entry-point group.

tests/plugin_pkg/ is what `pip install` of a plug-in leaves in site-packages: the package
(jobrun_testops/) and its metadata (jobrun_testops-0.1.dist-info/ with entry_points.txt).
With that folder on PYTHONPATH, importlib.metadata finds the entry point; without it the
op does not exist. Everything runs in subprocesses so that this process's registry cache
stays as it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from runner_util import HANG_S

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_PATH = ROOT / "tests" / "plugin_pkg"

PLAN = """\
job: plugin-demo
max_epochs: 1
init:
  - task: setup
    do:
      - const: {out: x, value: 3}
epoch:
  - task: twice
    do:
      - test.double: {in: x, out: y}
      - log: {in: [y]}
"""


def jobrun(*args: str, plugin: bool = True, code: str | None = None) -> subprocess.CompletedProcess[str]:
    # The environment's own path entries stay, minus the plug-in folder when the test
    # wants the plug-in absent.
    inherited = [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != PLUGIN_PATH
    ]
    paths = ([str(PLUGIN_PATH)] if plugin else []) + [str(ROOT), *inherited]
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "jobrun", *args]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    path = tmp_path / "plugin.yaml"
    path.write_text(PLAN)
    return path


def test_entry_point_is_found() -> None:
    code = (
        "from importlib.metadata import entry_points\n"
        "print([(e.name, e.value) for e in entry_points(group='jobrun.ops')])\n"
    )
    r = jobrun(code=code)
    assert r.returncode == 0, r.stderr
    assert "('double', 'jobrun_testops:SPEC')" in r.stdout


def test_ops_lists_it_under_user() -> None:
    r = jobrun("ops")
    assert r.returncode == 0, r.stderr
    sections = r.stdout.split("\nuser:\n")
    assert len(sections) == 2, r.stdout
    assert "test.double" in sections[1] and "test.double" not in sections[0]
    assert "Twice its input" in sections[1]


def test_ops_shows_it() -> None:
    r = jobrun("ops", "test.double")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("test.double  (user)")
    assert "in:   x" in r.stdout and "out:  y" in r.stdout


def test_analyze_and_print_know_it(plan: Path) -> None:
    r = jobrun("analyze", str(plan))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "unknown op" not in r.stdout + r.stderr
    r = jobrun("print", str(plan))
    assert r.returncode == 0, r.stderr
    assert "y = test.double(x)" in r.stdout


def test_without_the_plugin_the_op_is_unknown(plan: Path) -> None:
    r = jobrun("analyze", str(plan), plugin=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "unknown op 'test.double'" in r.stdout
    assert "test.double" not in jobrun("ops", plugin=False).stdout


def test_registry_reads_the_spec_without_importing_torch_or_the_impl() -> None:
    code = (
        "import sys\n"
        "from jobrun.ops.registry import registry\n"
        "spec = registry()['test.double']\n"
        "print(spec.category, spec.impl, spec.input_bounds, spec.output_bounds)\n"
        "print('torch' in sys.modules)\n"
    )
    r = jobrun(code=code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["user jobrun_testops:double (1, 1) (1, 1)", "False"]


def test_the_implementation_resolves() -> None:
    code = (
        "from jobrun.ops.registry import registry, resolve_impl\n"
        "print(resolve_impl(registry()['test.double'])(None, 21))\n"
    )
    r = jobrun(code=code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "42"
