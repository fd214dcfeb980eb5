"""Every broken plan in tests/bad_plans/ fails through the real CLI with one clear message.

Each corpus file starts with its expectation::

    # expect: <exit code> <line>:<col> <words...>
    # cmd: print                 (optional; default: analyze)
    # args: --set max_epochs     (optional extra arguments)

`<line>:<col>` is where the message must point in that file (`-` when the error is about
the command line, not the file); every word must appear in the message or its hint.
Nothing may print a traceback. The cases run in-process (the CLI's own entry point), and
a few of them again as `python -m jobrun` processes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from runner_util import HANG_S

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "bad_plans"


@dataclass(frozen=True)
class Case:
    name: str
    path: str  # as given on the command line (relative to ROOT for corpus files)
    exit: int
    pos: str | None  # "line:col", or None for errors without a place in the file
    words: tuple[str, ...]
    cmd: str = "analyze"
    args: tuple[str, ...] = ()


def _corpus_case(path: Path) -> Case:
    # Header lines are ASCII even in the files that hold broken bytes further down.
    lines = path.read_bytes().decode("utf-8", "replace").splitlines()
    head = lines[0].removeprefix("# expect:").split()
    assert lines[0].startswith("# expect:") and len(head) >= 3, f"{path.name}: bad expect line"
    meta = {}
    for line in lines[1:3]:
        key, sep, value = line.removeprefix("# ").partition(": ")
        if line.startswith("# ") and sep and key in ("cmd", "args"):
            meta[key] = value
    return Case(
        name=path.stem,
        path=str(path.relative_to(ROOT)),
        exit=int(head[0]),
        pos=None if head[1] == "-" else head[1],
        words=tuple(head[2:]),
        cmd=meta.get("cmd", "analyze"),
        args=tuple(shlex.split(meta.get("args", ""))),
    )


# Cases a corpus file cannot hold: an empty file cannot carry its own header.
_MISSING = str(ROOT / "tests" / "bad_plans" / "no_such_plan.yml")
_TABLE = [
    Case("empty_file", "<tmp>/empty.yaml", 2, "1:1", ("plan", "file", "is", "empty", "job:")),
    Case("empty_file_print", "<tmp>/empty.yaml", 2, "1:1", ("plan", "file", "is", "empty"), cmd="print"),
    Case("missing_file", _MISSING, 2, None, ("no", "such", "plan", "file")),
]

CASES = sorted((_corpus_case(p) for p in CORPUS.glob("*.yaml")), key=lambda c: c.name) + _TABLE


def test_corpus_is_big_enough() -> None:
    assert len(CASES) >= 35


@dataclass(frozen=True)
class Result:
    path: str
    returncode: int
    stdout: str
    stderr: str


def _run(case: Case, tmp: Path) -> Result:
    from runner_util import jobrun

    path = case.path.replace("<tmp>", str(tmp))
    r = jobrun(case.cmd, path, *case.args)  # an exception other than a clean exit fails here
    return Result(path, r.code, r.out, r.err)


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    tmp = tmp_path_factory.mktemp("bad_plans")
    (tmp / "empty.yaml").write_bytes(b"")
    here = os.getcwd()
    os.chdir(ROOT)  # corpus paths are relative to the checkout, as a user types them
    try:
        return {c.name: _run(c, tmp) for c in CASES}
    finally:
        os.chdir(here)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("alias_bomb", "missing_file", "empty_file")],
                         ids=lambda c: c.name)
def test_bad_plan_in_a_new_process(case: Case, tmp_path: Path, monkeypatch) -> None:
    """A few cases through `python -m jobrun` as well: the same exit and message."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "empty.yaml").write_bytes(b"")
    path = case.path.replace("<tmp>", str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "jobrun", case.cmd, path, *case.args], cwd=ROOT,
                          capture_output=True, text=True, errors="replace", timeout=HANG_S)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == case.exit
    assert proc.stderr == _run(case, tmp_path).stderr


def _message_block(text: str, head: str) -> str:
    """The diagnostic that starts with `head`, with its hint line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(head):
            hint = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("  hint:") else ""
            return line + "\n" + hint
    return ""


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_plan(case: Case, results: dict[str, Result]) -> None:
    r = results[case.name]
    both = r.stdout + r.stderr
    shown = f"\n--- stdout:\n{r.stdout}\n--- stderr:\n{r.stderr}"
    assert "Traceback" not in both, shown
    assert r.returncode == case.exit, shown
    if case.pos is not None:
        head = f"{r.path}:{case.pos}: error:"
        # Plan errors (exit 2) go to stderr; analyzer diagnostics (exit 1) to stdout.
        block = _message_block(r.stderr if case.exit == 2 else r.stdout, head)
        assert block, f"no message at {head}{shown}"
    else:
        block = r.stderr
        assert "error:" in block and ":0:" not in block, shown
    for word in case.words:
        assert word in block, f"{word!r} missing from:\n{block}{shown}"
    if case.exit == 2:
        # One message, not a list of them: the file cannot be read as a plan.
        assert r.stderr.count("error:") == 1, shown
