from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Subprocesses started by tests find the helper modules in tests/ too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker ignores SIGINT, and the processes the tests start would
    inherit that (jobrun keeps an ignored SIGINT ignored, as after `nohup`): they start
    with Ctrl-C acting, as from a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def plan_file(tmp_path):
    """Write a plan text to tmp_path/plan.yaml and return its path."""

    def write(text: str, name: str = "plan.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
