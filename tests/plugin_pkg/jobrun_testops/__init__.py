"""A tiny op plug-in for tests: registers `test.double` through the `jobrun.ops` group.

Putting tests/plugin_pkg on PYTHONPATH is enough: importlib.metadata finds the
hand-written jobrun_testops-0.1.dist-info/ next to this package, whose entry_points.txt
names SPEC. jobrun reads the spec to print and analyze plans, and imports `double` only
when a job runs.
"""

from __future__ import annotations

from typing import Any

from jobrun.ops.spec import OpSpec

SPEC = OpSpec(
    "test.double",
    "Twice its input (a test plug-in).",
    "jobrun_testops:double",
    inputs=("x",),
    outputs=("y",),
    example="- test.double: {in: a, out: b}",
)


def double(ctx: Any, x: Any) -> Any:
    return x * 2
