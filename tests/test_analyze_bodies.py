"""`analyze` on the shape of bodies: empty `do:` (warnings) and `loop: null` that never ends (errors)."""

from __future__ import annotations

import pytest

from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_text

HEAD = "job: j\nmax_epochs: 1\nepoch:\n  - task: t\n    do:\n"


def diags(text: str) -> list[tuple[str, str, int, int, str]]:
    return [(d.severity, d.code, d.pos.line, d.pos.col, d.message) for d in analyze(compile_text(text, "t.yaml"))]


@pytest.mark.parametrize("body", ["null", "[]"])
def test_an_empty_task_is_a_warning_at_the_task(body: str) -> None:
    assert diags(f"job: j\nmax_epochs: 1\nepoch:\n  - task: t\n    do: {body}\n") == [
        ("warning", "empty-body", 4, 5, "task 't' of group `epoch` has no steps: it does nothing")
    ]


def test_a_task_with_only_exit_steps_is_not_empty() -> None:
    text = "job: j\nmax_epochs: 1\nepoch:\n  - task: t\n    do: []\n    exit: [{const: {out: a, value: 1}}]\n"
    assert [d[1] for d in diags(text)] == ["unused"]


@pytest.mark.parametrize("body", ["null", "[]"])
def test_an_empty_loop_report_or_branch_is_a_warning_at_its_keyword(body: str) -> None:
    text = HEAD + (
        f"      - loop: 2\n        do: {body}\n"
        f"      - report: 1s\n        do: {body}\n"
        f"      - parallel:\n          - {{name: a, do: {body}}}\n          - {{do: [{{const: {{out: b, value: 1}}}}]}}\n"
        "    outputs: [b]\n"
    )
    assert diags(text) == [
        ("warning", "empty-body", 6, 9, "this loop has no steps in its `do`"),
        ("warning", "empty-body", 8, 9, "this report has no steps in its `do`"),
        ("warning", "empty-body", 11, 13, "branch 'a' of this `parallel` has no steps in its `do`"),
    ]


def test_a_loop_null_without_a_stop_if_never_ends() -> None:
    text = HEAD + (
        "      - const: {out: a, value: 1}\n"
        "      - loop: null\n        do:\n"
        "          - add: {in: [a, 1], out: a}\n"
        "          - loop: null\n            do: [{stop_if: a}]\n"  # leaves the inner loop only
        "          - report: 1s\n            do: [{stop_if: a}]\n"  # ends the report's body only
    )
    assert diags(text) == [
        ("error", "endless-loop", 7, 9, "this `loop: null` never ends: no `stop_if` in its body leaves it")
    ]


@pytest.mark.parametrize("stop", [
    "- stop_if: a",
    "- if: a\n            then: [{stop_if: a}]",
    "- parallel:\n            - {do: [{stop_if: a}]}",
])
def test_a_stop_if_in_the_body_an_if_or_a_branch_ends_a_loop_null(stop: str) -> None:
    text = HEAD + f"      - const: {{out: a, value: true}}\n      - loop: null\n        do:\n          {stop}\n"
    assert [d[1] for d in diags(text)] == []


def test_max_steps_ends_a_loop_null_that_trains() -> None:
    text = HEAD.replace("max_epochs: 1", "max_steps: 3") + "      - loop: null\n        do: [{call: {fn: 'm:f'}}]\n"
    assert [d[1] for d in diags(text)] == []


def test_max_steps_does_not_end_a_loop_null_outside_the_epoch_group() -> None:
    """The runner ends the loops of epoch tasks at max_steps; an init loop never ends."""
    text = ("job: j\nmax_steps: 3\ninit:\n  - task: s\n    do:\n      - loop: null\n"
            "        do: [{log: {msg: x}}]\nepoch:\n  - task: t\n    do: [{log: {msg: y}}]\n")
    assert [d[1] for d in diags(text)] == ["endless-loop"]


def test_max_steps_does_not_end_a_loop_null_that_takes_no_optimizer_step() -> None:
    """max_steps counts optimizer steps: a loop of train.step or call may end by it, a
    loop of `add` never does (a plug-in op may step, so it is given the benefit)."""
    head = "job: j\nmax_steps: 3\nepoch:\n  - task: t\n    do:\n      - const: {out: a, value: 1}\n"
    adds = head + "      - loop: null\n        do: [{add: {in: [a, 1], out: a}}]\n"
    assert [d[1] for d in diags(adds)] == ["endless-loop"]
    nested = head + "      - loop: null\n        do:\n          - if: a\n            then: [{call: {fn: 'm:f'}}]\n"
    assert "endless-loop" not in [d[1] for d in diags(nested)]
