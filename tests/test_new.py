"""`jobrun new`: a plan from a bundled example, that trains as it is; and the examples
ship inside the package."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from runner_util import HANG_S, jobrun

ROOT = Path(__file__).resolve().parent.parent


def test_list_names_every_example_with_its_summary():
    r = jobrun("new", "--list")
    assert r.code == 0, r.text
    names = [line.split()[0] for line in r.out.splitlines()]
    assert names == sorted(p.stem for p in (ROOT / "plans").glob("*.yaml"))
    assert any("MLP" in line for line in r.out.splitlines() if line.startswith("mlp"))


def test_a_new_plan_trains_as_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = jobrun("new", "demo", "--from", "counter")
    assert r.code == 0, r.text
    assert "jobrun train demo/plan.yaml" in r.out
    text = (tmp_path / "demo" / "plan.yaml").read_text()
    assert "job: demo\n" in text and "job: counter" not in text
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["plan.yaml"]
    t = jobrun("train", "demo/plan.yaml")
    assert t.code == 0, t.text
    assert (tmp_path / "runs" / "demo" / "1" / "run.json").is_file()


def test_an_example_with_user_code_and_data_comes_with_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert jobrun("new", "lm", "--from", "charlm").code == 0
    made = tmp_path / "lm"
    assert (made / "models" / "charlm.py").read_text() == (ROOT / "plans/models/charlm.py").read_text()
    assert (made / "data" / "tiny.txt").read_bytes() == (ROOT / "plans/data/tiny.txt").read_bytes()
    assert jobrun("analyze", made / "plan.yaml").code == 0


@pytest.mark.parametrize(("args", "message"), [
    (["demo", "--from", "mpl"], "did you mean 'mlp'"),
    (["../up"], "bad name"),
    ([], "give a NAME"),
])
def test_bad_requests_are_one_message(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    r = jobrun("new", *args)
    assert r.code == 2 and message in r.err
    assert list(tmp_path.iterdir()) == []


def test_nothing_is_overwritten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "plan.yaml").write_text("mine\n")
    r = jobrun("new", "demo")
    assert r.code == 2 and "exists already" in r.err
    assert (tmp_path / "demo" / "plan.yaml").read_text() == "mine\n"


def test_pyproject_lists_every_package():
    """The package list is explicit (the examples come from plans/): a new package of
    jobrun that is not listed would be missing from the wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "jobrun").rglob("__init__.py")}
    found |= {"jobrun.examples." + ".".join(p.parent.relative_to(ROOT / "plans").parts)
              for p in (ROOT / "plans").rglob("__init__.py") if p.parent != ROOT / "plans"}
    assert listed == found | {"jobrun.examples", "jobrun.examples.data"}  # data: files, no code


@pytest.mark.slow
def test_the_wheel_holds_the_examples(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr[-2000:]
    wheel = next(tmp_path.glob("jobrun-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for example in (ROOT / "plans").glob("*.yaml"):
        assert f"jobrun/examples/{example.name}" in names
    assert {"jobrun/examples/models/charlm.py", "jobrun/examples/data/tiny.txt"} <= names
