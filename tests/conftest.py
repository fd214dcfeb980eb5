from __future__ import annotations

import os
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


@pytest.fixture
def plan_file(tmp_path):
    """Write a plan text to tmp_path/plan.yaml and return its path."""

    def write(text: str, name: str = "plan.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
