"""`jobrun analyze`: one small plan per check, clean example plans, order, JSON, no torch, speed.

Positions are asserted exactly, but located in the plan text by `at(...)` rather than
written as numbers, so that a test says *which token* a diagnostic must point at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from runner_util import HANG_S

from jobrun.errors import Pos
from jobrun.ops.registry import registry
from jobrun.ops.spec import OpSpec, arg
from jobrun.plans import ir
from jobrun.plans.analyze import Diagnostic, analyze
from jobrun.plans.compile import compile_file, compile_text

ROOT = Path(__file__).resolve().parent.parent
PLANS = sorted((ROOT / "plans").glob("*.yaml"))
FILE = "t.yaml"


def run(text: str) -> list[Diagnostic]:
    return analyze(compile_text(textwrap.dedent(text), FILE))


def at(text: str, line_has: str, token: str | None = None, nth: int = 1) -> tuple[int, int]:
    """(line, col) of `token` (default: `line_has`) on the nth line containing `line_has`.

    The token is searched from where `line_has` starts on that line.
    """
    lines = [
        (number, line)
        for number, line in enumerate(textwrap.dedent(text).splitlines(), 1)
        if line_has in line
    ]
    assert len(lines) >= nth, f"{line_has!r} is not {nth} time(s) in the plan"
    number, line = lines[nth - 1]
    return number, line.index(token if token is not None else line_has, line.index(line_has)) + 1


def only(text: str, code: str) -> Diagnostic:
    """The one diagnostic of `text`; it must have `code`."""
    diags = run(text)
    assert [d.code for d in diags] == [code], "\n".join(d.format() for d in diags)
    return diags[0]


def expect(
    d: Diagnostic,
    severity: str,
    where: tuple[int, int],
    message: tuple[str, ...],
    hint: tuple[str, ...] = (),
) -> None:
    assert d.severity == severity, d.format()
    assert (d.pos.file, d.pos.line, d.pos.col) == (FILE, *where), d.format()
    for word in message:
        assert word in d.message, d.format()
    for word in hint:
        assert d.hint is not None and word in d.hint, d.format()


def codes(text: str) -> list[tuple[str, str]]:
    return [(d.severity, d.code) for d in run(text)]


CLEAN = """
job: clean
max_epochs: 3
stop_when: [done]
init:
  - task: setup
    do:
      - const: {out: total, value: 0}
      - const: {out: limit, value: 2}
epoch:
  - task: count
    do:
      - loop: 3
        as: i
        do:
          - add: {in: [total, i], out: total}
      - ge: {in: [total, limit], out: done}
    outputs: [done]
exit:
  - task: final
    do:
      - log: {in: [total], msg: final}
"""


# -- clean plans ---------------------------------------------------------------------------


def test_clean_plan_has_no_diagnostics() -> None:
    assert run(CLEAN) == []


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_example_plans_have_no_errors(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    diags = analyze(compile_file(path.relative_to(ROOT)))
    assert [d.format() for d in diags if d.severity == "error"] == []


# -- ops and arguments ---------------------------------------------------------------------


def test_unknown_op_suggests_a_close_name() -> None:
    text = CLEAN.replace("- const: {out: limit, value: 2}", "- fil: {out: limit, value: 2}")
    d = only(text, "unknown-op")
    expect(d, "error", at(text, "- fil:", "fil"), ("unknown op 'fil'",), ("did you mean 'fill'?",))


def test_unknown_op_names_every_equally_close_op() -> None:
    text = CLEAN.replace(
        "- ge: {in: [total, limit], out: done}", "- ad: {in: [total, limit], out: done}"
    )
    assert only(text, "unknown-op").hint == "did you mean 'add' or 'and'?"


def test_unknown_op_without_close_name_points_to_ops_list() -> None:
    text = CLEAN.replace("- const: {out: limit, value: 2}", "- zzzqqq: {out: limit}")
    expect(only(text, "unknown-op"), "error", at(text, "zzzqqq"), ("'zzzqqq'",), ("jobrun ops",))


def test_unknown_argument() -> None:
    text = CLEAN.replace("{out: limit, value: 2}", "{out: limit, valeu: 2}")
    d = [d for d in run(text) if d.code == "unknown-arg"][0]
    expect(
        d, "error", at(text, "valeu: 2", "valeu"), ("`const`", "`valeu`"), ("did you mean 'value'?",)
    )


def test_unknown_argument_of_an_op_without_arguments() -> None:
    text = CLEAN.replace(
        "- ge: {in: [total, limit], out: done}", "- ge: {in: [total, limit], out: done, eps: 1}"
    )
    d = only(text, "unknown-arg")
    expect(
        d,
        "error",
        at(text, "eps: 1", "eps"),
        ("`ge` has no argument `eps`",),
        ("takes no arguments",),
    )


def test_extra_arguments_are_fine_where_the_op_takes_them() -> None:
    text = CLEAN.replace(
        "- log: {in: [total], msg: final}", '- call: {fn: "mod:f", in: [total], out: t2, scale: 2}'
    )
    assert codes(text) == [("warning", "unused")]  # t2 is never read; `scale` is fine


def test_missing_required_argument() -> None:
    text = CLEAN.replace(
        "- const: {out: limit, value: 2}", "- const: {out: limit, value: 2}\n      - fill: {out: w}"
    )
    d = [d for d in run(text) if d.code == "missing-arg"][0]
    expect(
        d,
        "error",
        at(text, "- fill:", "fill"),
        ("`fill` needs argument `shape`",),
        ("add `shape: ...`", "shape"),
    )


@pytest.mark.parametrize(
    ("args", "value_text", "words"),
    [
        ("shape: [2], dtype: float33", "float33", ("`dtype`", "'float33'", "one of")),
        ("shape: [2], value: hello", "hello", ("`value`", "a number or true or false")),
        ("shape: 3", "3", ("`shape`", "a shape")),
        ("shape: [2, -1]", "[2, -1]", ("`shape`", "integers >= 0")),
    ],
)
def test_argument_of_the_wrong_type(args: str, value_text: str, words: tuple[str, ...]) -> None:
    text = CLEAN.replace(
        "- const: {out: limit, value: 2}",
        f"- const: {{out: limit, value: 2}}\n      - fill: {{out: w, {args}}}",
    )
    d = only(text, "arg-type")
    expect(d, "error", at(text, "- fill:", value_text), words)


def test_choice_argument_suggests_a_close_value() -> None:
    text = CLEAN.replace(
        "{out: limit, value: 2}",
        "{out: limit, value: 2}\n      - fill: {out: w, shape: [2], dtype: float33}",
    )
    assert only(text, "arg-type").hint == "did you mean 'float32'?"


def test_null_where_the_type_allows_it() -> None:
    assert run(CLEAN.replace("msg: final", "msg: null")) == []


def test_an_injected_registry_and_its_argument_types() -> None:
    wait = OpSpec(
        "wait",
        "Wait a while.",
        "tests.helpers:wait",
        inputs=("x",),
        min_inputs=0,
        args=(
            arg("period", "duration"),
            arg("tries", ("or", "int", "null"), None),
            arg("mode", ("or", ("choice", "fast", "slow"), "null"), None),
            arg("odd", ["a list is no type"], None),  # unknown type language: accepted
        ),
    )
    ops = {"const": registry()["const"], "wait": wait}
    text = """
    job: t
    max_epochs: 1
    epoch:
      - task: e
        do:
          - wait: {period: 500ms, tries: null, mode: slow, odd: 1}
          - wait: {period: 5 minutes, tries: 2.5, mode: quick}
    """
    diags = analyze(compile_text(textwrap.dedent(text), FILE), ops)
    assert [(d.code, d.pos.col) for d in diags] == [
        ("arg-type", at(text, "5 minutes")[1]),
        ("arg-type", at(text, "tries: 2.5", "2.5")[1]),
        ("arg-type", at(text, "mode: quick", "quick")[1]),
    ]
    assert "a duration (500ms, 2s)" in diags[0].message
    assert "an integer or null" in diags[1].message
    assert "one of 'fast', 'slow' or null" in diags[2].message


def test_absurd_shape_size() -> None:
    text = CLEAN.replace(
        "- const: {out: limit, value: 2}",
        "- const: {out: limit, value: 2}\n      - randn: {out: w, shape: [100000, 100000, 10]}",
    )
    d = only(text, "arg-value")
    expect(d, "error", at(text, "randn", "[100000"), ("100000000000 elements", "2**34"))


def test_mlp_sizes_are_widths_not_a_shape() -> None:
    # A deep MLP's widths multiply past 2**34: they are layer sizes, not a tensor's shape.
    deep = CLEAN.replace(
        "- const: {out: limit, value: 2}",
        "- const: {out: limit, value: 2}\n      - model.mlp: {out: net, sizes: [256, 512, 512, 512, 10]}",
    )
    assert not [d for d in run(deep) if d.code.startswith("arg")]
    zero = deep.replace("[256, 512, 512, 512, 10]", "[256, 0, 10]")
    d = only(zero, "arg-type")
    expect(d, "error", at(zero, "model.mlp", "[256"), ("a list of sizes (integers >= 1)",))


def test_input_count() -> None:
    text = CLEAN.replace("- ge: {in: [total, limit], out: done}", "- ge: {in: [total], out: done}")
    d = only(text, "in-count")
    expect(
        d,
        "error",
        at(text, "- ge:", "ge"),
        ("`ge` takes exactly 2 inputs, got 1",),
        ("- ge: {in: [a, b], out: c}",),
    )


def test_output_count() -> None:
    text = CLEAN.replace(
        "- ge: {in: [total, limit], out: done}", "- ge: {in: [total, limit], out: [done, more]}"
    )
    d = only(text, "out-count")
    expect(d, "error", at(text, "- ge:", "ge"), ("`ge` takes exactly 1 output, got 2",))


def test_variadic_inputs_and_literals_are_fine() -> None:
    assert run(CLEAN.replace("in: [total, i]", "in: [total, i, 1, 2.5, true]")) == []


# -- undefined blobs -------------------------------------------------------------------------


def test_read_before_any_definition() -> None:
    text = CLEAN.replace("in: [total, limit]", "in: [total, ghost]")
    d = only(text, "undefined-blob")
    expect(
        d,
        "error",
        at(text, "in: [total, ghost]", "ghost"),
        ("blob 'ghost' is read before it is defined", "task 'count'", "node 'local'"),
        ("define 'ghost' first",),
    )


def test_read_before_a_later_definition_points_at_it() -> None:
    text = CLEAN.replace(
        "- log: {in: [total], msg: final}",
        "- log: {in: [late]}\n      - const: {out: late, value: 1}",
    )
    d = only(text, "undefined-blob")
    expect(
        d,
        "error",
        at(text, "in: [late]", "late"),
        ("'late'",),
        (f"first defined at line {at(text, 'out: late')[0]}",),
    )


def test_in_place_update_of_a_blob_nothing_creates() -> None:
    text = CLEAN.replace(
        "in: [total], msg: final",
        "in: [total], msg: final}\n      - add: {in: [count, 1], out: count",
    )
    d = only(text, "undefined-blob")
    expect(
        d, "error", at(text, "in: [count, 1]", "count"), ("'count'",), ("updates 'count' in place",)
    )


def test_a_blob_a_loop_carries_that_nothing_creates_is_to_be_made_before_the_loop() -> None:
    """An RNN's hidden state read and written back by each step of an epoch's loop, with
    no first value, got "add e.g. a `const` in `init`": one made there is carried from
    epoch to epoch (and saved), where word_language_model starts it afresh every epoch.
    The hint names the loop and both places."""
    text = CLEAN.replace(
        "- add: {in: [total, i], out: total}",
        "- add: {in: [total, i], out: total}\n          - add: {in: [state, i], out: state}",
    )
    d = only(text, "undefined-blob")
    expect(
        d, "error", at(text, "in: [state, i]", "state"), ("'state'",),
        (f"before the loop at line {at(text, 'loop: 3')[0]}", "each time the task runs", "`init`"),
    )


def test_undefined_blob_suggests_a_close_name() -> None:
    text = CLEAN.replace("in: [total], msg", "in: [totl], msg")
    assert only(text, "undefined-blob").hint == "did you mean 'total'?"


MISSPELT_BATCH = """\
job: t
max_epochs: 1
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 4, classes: 2}
      - reader: {in: [x, y], out: data, batch_size: 8, passes: 0}
      - model.mlp: {out: model, sizes: [4, 2]}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {in: data, out: [xb, yb, end]}
          - stop_if: end
          - train.step: {in: [model, opt, xb, READ], out: loss}
    outputs: [loss]
"""


@pytest.mark.parametrize(("read", "hint"), [
    ("yy", "did you mean 'yb' or 'y'?"),  # difflib alone: 'y', the whole data set of init
    ("by", "did you mean 'yb' or 'y'?"),  # two letters swapped
])
def test_undefined_blob_suggests_first_a_typo_of_a_blob_its_task_made(read: str, hint: str) -> None:
    assert only(MISSPELT_BATCH.replace("READ", read), "undefined-blob").hint == hint


def test_blobs_of_another_node_are_not_visible() -> None:
    text = CLEAN.replace("  - task: final\n", "  - task: final\n    node: other\n")
    d = only(text, "undefined-blob")
    expect(
        d,
        "error",
        at(text, "in: [total], msg", "total"),
        ("node 'other'",),
        ("defined on node 'local'",),
    )


def test_if_and_loop_conditions_must_be_defined() -> None:
    text = CLEAN.replace(
        "- ge: {in: [total, limit], out: done}",
        "- ge: {in: [total, limit], out: done}\n"
        "      - if: cond\n        then: [{log: {in: [total]}}]\n"
        "      - loop: times\n        do: [{log: {in: [total]}}]\n"
        "      - stop_if: halt",
    )
    diags = run(text)
    assert [(d.code, d.pos.line, d.pos.col) for d in diags] == [
        ("undefined-blob", *at(text, "if: cond", "cond")),
        ("undefined-blob", *at(text, "loop: times", "times")),
        ("undefined-blob", *at(text, "stop_if: halt", "halt")),
    ]


def test_in_place_update_and_stop_if_outside_a_loop_are_fine() -> None:
    text = CLEAN.replace(
        "- ge: {in: [total, limit], out: done}",
        "- ge: {in: [total, limit], out: done}\n      - stop_if: done",
    )
    assert run(text) == []


IF_PLAN = """
job: t
max_epochs: 1
init:
  - task: setup
    do:
      - const: {out: c, value: true}
epoch:
  - task: e
    do:
      - if: c
        then: [{const: {out: x, value: 1}}, {const: {out: y, value: 1}}]
        {else}
      - log: {in: [x, y]}
"""


def test_blob_defined_in_only_some_branches_of_an_if() -> None:
    text = IF_PLAN.replace(
        "{else}",
        "elif: [{if: c, then: [{const: {out: y, value: 2}}]}]\n        else: [{const: {out: y, value: 3}}]",
    )
    d = only(text, "maybe-undefined")
    expect(
        d,
        "warning",
        at(text, "in: [x, y]", "x"),
        (
            "blob 'x' may be undefined here",
            f"only in some branches of the `if` at line {at(text, 'if: c')[0]}",
        ),
        ("define 'x' on every path",),
    )


def test_blob_defined_in_every_branch_of_an_if() -> None:
    text = IF_PLAN.replace(
        "{else}", "else: [{const: {out: x, value: 2}}, {const: {out: y, value: 2}}]"
    )
    assert run(text) == []


def test_if_without_else_leaves_its_blobs_maybe_undefined() -> None:
    text = IF_PLAN.replace("{else}", "")
    assert [(d.code, d.pos.col) for d in run(text)] == [
        ("maybe-undefined", at(text, "in: [x, y]", "x")[1]),
        ("maybe-undefined", at(text, "in: [x, y]", "y")[1]),
    ]


LOOP_PLAN = """
job: t
max_epochs: 1
init:
  - task: setup
    do:
      - const: {out: n, value: 2}
      - const: {out: flag, value: false}
epoch:
  - task: e
    workspace: global  # no `unused` warnings: this is about definedness
    do:
      - loop: COUNT
        as: i
        do:
          - const: {out: early, value: 1}
          - stop_if: flag
          - const: {out: late, value: 1}
      - log: {in: [READ]}
"""


@pytest.mark.parametrize(
    ("count", "read", "why"),
    [
        ("3", "early, i", None),
        ("null", "early, i", None),  # `loop: null` runs its body at least once, up to a stop_if
        ("3", "late", "after the stop_if at line"),
        ("null", "late", "after the stop_if at line"),
        ("0", "early", "may run 0 times"),
        ("n", "i", "may run 0 times"),
    ],
)
def test_loop_definitions(count: str, read: str, why: str | None) -> None:
    text = LOOP_PLAN.replace("COUNT", count).replace("READ", read)
    diags = run(text)
    if why is None:
        assert diags == []
    else:
        d = only(text, "maybe-undefined")
        expect(
            d, "warning", at(text, "- log:", f"{read}]"), (f"blob '{read}' may be undefined", why)
        )


def test_stop_if_outside_a_loop_makes_later_blobs_maybe_undefined_in_exit_and_outputs() -> None:
    text = """
    job: t
    max_epochs: 1
    epoch:
      - task: e
        do:
          - const: {out: flag, value: true}
          - stop_if: flag
          - const: {out: result, value: 1}
        exit:
          - log: {in: [result]}
        outputs: [result]
    """
    diags = run(text)
    assert [(d.code, d.severity) for d in diags] == [("maybe-undefined", "warning")] * 2
    expect(diags[0], "warning", at(text, "in: [result]", "result"), ("after the stop_if at line",))
    expect(
        diags[1],
        "warning",
        at(text, "outputs: [result]", "result"),
        ("output 'result' of task 'e' may be undefined",),
    )


# -- workspaces and groups -------------------------------------------------------------------


def test_private_task_blobs_are_dropped_when_it_ends() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: setup
        workspace: private
        do:
          - const: {out: w, value: 1}
        outputs: [w]
    epoch:
      - task: e
        do:
          - log: {in: [w]}
    """
    d = only(text, "undefined-blob")
    expect(
        d,
        "error",
        at(text, "in: [w]", "w"),
        ("'w'",),
        ("private task 'setup'", "workspace: global"),
    )


def test_private_task_updates_existing_global_blobs_and_outputs_stay_private() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: setup
        do:
          - const: {out: total, value: 0}
    epoch:
      - task: e
        do:
          - add: {in: [total, 1], out: total}
          - const: {out: loss, value: 0.5}
        outputs: [loss]
    exit:
      - task: final
        do:
          - log: {in: [total]}
          - log: {in: [loss]}
    """
    d = only(text, "undefined-blob")
    expect(d, "error", at(text, "in: [loss]", "loss"), ("'loss'",), ("private task 'e'",))


def test_global_epoch_task_blobs_are_visible_afterwards() -> None:
    text = """
    job: t
    max_epochs: 1
    epoch:
      - task: e
        workspace: global
        do:
          - const: {out: loss, value: 0.5}
    exit:
      - task: final
        do:
          - log: {in: [loss]}
    """
    assert run(text) == []


def test_task_relying_on_another_task_of_its_group() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: make
        do:
          - const: {out: w, value: 1}
      - task: use
        do:
          - log: {in: [w]}
    epoch:
      - task: tick
        do:
          - log: {msg: tick}
    """
    d = only(text, "group-order")
    expect(
        d,
        "warning",
        at(text, "in: [w]", "w"),
        (
            "task 'use' reads 'w', which task 'make' of the same group `init` creates",
            "concurrently",
        ),
        ("earlier group",),
    )


def test_epoch_read_of_a_blob_a_later_step_creates_works_from_the_second_epoch() -> None:
    text = """
    job: t
    max_epochs: 2
    epoch:
      - task: e
        workspace: global
        do:
          - log: {in: [prev]}
          - const: {out: prev, value: 1}
    """
    d = only(text, "maybe-undefined")
    expect(
        d,
        "warning",
        at(text, "in: [prev]", "prev"),
        ("undefined in the first epoch", "second epoch"),
        ("`init`",),
    )


def test_same_plan_outside_epoch_is_an_error() -> None:
    text = """
    job: t
    max_epochs: 2
    init:
      - task: e
        do:
          - log: {in: [prev]}
          - const: {out: prev, value: 1}
    epoch:
      - task: tick
        do:
          - log: {msg: tick}
    """
    assert codes(text) == [("error", "undefined-blob")]


# -- races ---------------------------------------------------------------------------------


def test_two_tasks_of_a_group_create_one_global_blob() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: a
        do:
          - const: {out: w, value: 1}
      - task: b
        do:
          - const: {out: w, value: 2}
    epoch:
      - task: tick
        do:
          - log: {msg: tick}
    """
    d = only(text, "race")
    expect(
        d,
        "error",
        at(text, "{out: w, value: 2}", "w"),
        ("'w' is created in the global workspace of node 'local' by tasks 'a' and 'b' of group `init`",),
        ("let one task own 'w'",),
    )


def test_two_tasks_of_a_group_write_one_existing_global_blob() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: setup
        do:
          - const: {out: total, value: 0}
    epoch:
      - task: a
        do:
          - add: {in: [total, 1], out: total}
      - task: b
        workspace: global
        do:
          - add: {in: [total, 2], out: total}
    """
    d = only(text, "race")
    expect(
        d,
        "warning",
        at(text, "in: [total, 2]", "total}"),
        ("'total' is written", "tasks 'a' and 'b'"),
    )


def test_tasks_on_different_nodes_and_instances_do_not_race() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: a
        do:
          - const: {out: w, value: 1}
      - task: b
        node: other
        instances: 4
        do:
          - const: {out: w, value: 2}
          - add: {in: [w, 1], out: w}
    epoch:
      - task: tick
        do:
          - log: {msg: tick}
    """
    assert run(text) == []


PARALLEL = """
job: t
max_epochs: 1
init:
  - task: setup
    do:
      - const: {out: total, value: 0}
      - parallel:
          - name: left
            do: [{const: {out: a, value: 1}}, {add: {in: [total, 1], out: total}}]
          - do: [{const: {out: a, value: 2}}, {add: {in: [total, 2], out: total}}]
          - do: [{log: {in: [a]}}]
      - log: {in: [a]}
epoch:
  - task: tick
    do:
      - log: {msg: tick}
"""


def test_parallel_branches() -> None:
    diags = run(PARALLEL)
    assert [(d.severity, d.code) for d in diags] == [
        ("error", "race"),
        ("warning", "race"),
        ("warning", "race"),
    ]
    create, write, read = diags
    expect(
        create,
        "error",
        at(PARALLEL, "{out: a, value: 2}", "a"),
        ("'a' is created by two concurrent branches", "branches 'left' and #2"),
        ("before the `parallel`",),
    )
    expect(
        write, "warning", at(PARALLEL, "in: [total, 2]", "total}"), ("'total' is written by two",)
    )
    expect(
        read,
        "warning",
        at(PARALLEL, "- do: [{log: {in: [a]}}]", "a]"),
        ("branch #3 reads 'a'", "branch 'left' creates"),
    )


def test_parallel_branches_with_their_own_blobs_are_fine() -> None:
    text = PARALLEL.replace("{out: a, value: 2}", "{out: b, value: 2}").replace(
        "in: [total, 2], out: total", "in: [total, 2], out: t2"
    )
    text = text.replace("- do: [{log: {in: [a]}}]", "- do: [{log: {in: [total]}}]").replace(
        "- log: {in: [a]}", "- log: {in: [a, b, t2]}"
    )
    assert run(text) == []


# -- reports -------------------------------------------------------------------------------


def test_report_sees_earlier_blobs_and_its_own_appear_after_its_block() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: e
        do:
          - const: {out: before, value: 1}
          - loop: 2
            do:
              - report: 100ms
                do:
                  - log: {in: [before, after]}
                  - const: {out: seen, value: 1}
              - const: {out: after, value: 1}
              - log: {in: [seen]}
          - log: {in: [seen]}
    epoch:
      - task: tick
        do:
          - log: {msg: tick}
    """
    diags = run(text)
    assert [(d.code, d.pos.line, d.pos.col) for d in diags] == [
        ("undefined-blob", *at(text, "in: [before, after]", "after")),
        ("undefined-blob", *at(text, "- log: {in: [seen]}", "seen")),
    ]
    assert diags[1].hint is not None and "inside a `report`" in diags[1].hint


# -- stop conditions and outputs -----------------------------------------------------------


def test_stop_when_must_name_an_epoch_output() -> None:
    text = CLEAN.replace("stop_when: [done]", "stop_when: [don]")
    d = only(text, "stop-when")
    expect(
        d,
        "error",
        at(text, "stop_when: [don]", "don"),
        ("'don'", "not an output of any epoch task"),
        ("did you mean 'done'?",),
    )


def test_no_stop_condition() -> None:
    text = CLEAN.replace("max_epochs: 3\n", "").replace("stop_when: [done]\n", "")
    d = only(text, "no-stop")
    expect(
        d,
        "error",
        at(text, "job: clean", "job"),
        ("job 'clean' has no stop condition",),
        ("max_epochs", "stop_when"),
    )


def test_stop_when_alone_is_a_stop_condition() -> None:
    assert run(CLEAN.replace("max_epochs: 3\n", "")) == []


def test_undefined_output() -> None:
    text = CLEAN.replace("outputs: [done]", "outputs: [done, acc]")
    d = only(text, "undefined-output")
    expect(
        d,
        "error",
        at(text, "outputs: [done, acc]", "acc"),
        ("output 'acc' of task 'count' is never defined",),
        ("remove it from `outputs`",),
    )


def test_output_clash_between_epoch_tasks() -> None:
    text = CLEAN.replace(
        "exit:",
        "  - task: other\n    node: n2\n    do:\n      - const: {out: done, value: false}\n    outputs: [done]\nexit:",
    )
    d = only(text, "output-clash")
    expect(
        d,
        "warning",
        at(text, "outputs: [done]", "done", nth=2),
        ("output 'done' of task 'other' is also an output of task 'count'",),
        ("rename",),
    )


def test_output_clash_says_what_the_run_does_with_the_two_values() -> None:
    # The runner keeps both: stop_when tests each, early_stop takes the first task's, the
    # epoch line shows both, named by task (runner/job.py, monitor.py, display.py).
    text = (
        "job: j\nmax_epochs: 3\nstop_when: [done]\nearly_stop: {monitor: done, mode: max}\nepoch:\n"
        "  - task: a\n    do: [{const: {out: done, value: false}}]\n    outputs: [done]\n"
        "  - task: b\n    do: [{const: {out: done, value: true}}]\n    outputs: [done]\n"
    )
    d = only(text, "output-clash")
    assert d.message == (
        "output 'done' of task 'b' is also an output of task 'a' (line 6): stop_when stops the "
        "job when any of them is truthy, early_stop monitors the value of task 'a' (the first), "
        "the epoch line shows each with its task's name (a.done=... b.done=...)"
    )
    assert "keeps one value" not in (d.hint or "") and "metrics.jsonl keeps each" in (d.hint or "")


def test_output_clash_of_three_tasks_names_the_three_the_epoch_line_shows() -> None:
    # The epoch line shows every task's value: the warning at the second task names the
    # third's too.
    text = "job: j\nmax_epochs: 3\nepoch:\n" + "".join(
        f"  - task: {t}\n    do: [{{const: {{out: acc, value: 1}}}}]\n    outputs: [acc]\n" for t in "abc")
    said = [d.message for d in analyze(compile_text(text, "p.yaml")) if d.code == "output-clash"]
    assert [m.split(":")[0] for m in said] == [
        "output 'acc' of task 'b' is also an output of task 'a' (line 4)",
        "output 'acc' of task 'c' is also an output of task 'a' (line 4)"]
    assert all(m.endswith("the epoch line shows each with its task's name (a.acc=... b.acc=... c.acc=...)")
               for m in said), said


# -- unused --------------------------------------------------------------------------------


def test_unused_private_blob() -> None:
    text = CLEAN.replace(
        "- ge: {in: [total, limit], out: done}",
        "- ge: {in: [total, limit], out: done}\n      - mul: {in: [total, 2], out: twice}",
    )
    d = only(text, "unused")
    expect(
        d,
        "warning",
        at(text, "out: twice", "twice"),
        ("'twice' is defined but never read in private task 'count'",),
        ("dropped when the task ends",),
    )


def test_unused_is_quiet_for_global_blobs_outputs_and_positional_outputs() -> None:
    text = """
    job: t
    max_epochs: 1
    init:
      - task: setup
        do:
          - const: {out: never_read, value: 1}
          - const: {out: data, value: [1, 2, 3]}
    epoch:
      - task: e
        do:
          - reader: {in: data, out: r}
          - read: {in: r, out: [x, done]}
          - log: {in: [x]}
          - const: {out: result, value: 1}
        outputs: [result]
    """
    assert run(text) == []


# -- output format, order, determinism -----------------------------------------------------

MESSY = """
job: t
init:
  - task: a
    do:
      - fil: {out: w}
      - log: {in: [ghost]}
epoch:
  - task: e
    do:
      - log: {in: [w, nope]}
      - ge: {in: [w]}
"""


def test_diagnostics_are_sorted_by_position() -> None:
    diags = run(MESSY)
    keys = [(d.pos.file, d.pos.line, d.pos.col) for d in diags]
    assert keys == sorted(keys)
    assert {d.code for d in diags} == {
        "no-stop",
        "unknown-op",
        "undefined-blob",
        "in-count",
        "out-count",
    }


def test_format_and_json() -> None:
    d = Diagnostic(
        "error",
        Pos("p.yaml", 3, 7),
        "blob 'x' is read before it is defined",
        "undefined-blob",
        "define it",
    )
    assert (
        d.format() == "p.yaml:3:7: error: blob 'x' is read before it is defined\n  hint: define it"
    )
    assert (
        Diagnostic("warning", Pos("p.yaml", 1, 1), "m", "unused").format()
        == "p.yaml:1:1: warning: m"
    )
    assert d.to_json() == {
        "severity": "error",
        "code": "undefined-blob",
        "message": "blob 'x' is read before it is defined",
        "hint": "define it",
        "file": "p.yaml",
        "line": 3,
        "col": 7,
    }
    for diag in run(MESSY):
        assert set(diag.to_json()) == {"severity", "code", "message", "hint", "file", "line", "col"}
        json.dumps(diag.to_json())


def test_output_is_deterministic_across_processes(tmp_path: Path) -> None:
    paths = []
    for name, text in (
        ("messy", MESSY),
        ("parallel", PARALLEL),
        ("if", IF_PLAN.replace("{else}", "")),
    ):
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(textwrap.dedent(text))
    script = (
        "import json, sys\n"
        "from jobrun.plans.compile import compile_file\n"
        "from jobrun.plans.analyze import analyze\n"
        "for path in sys.argv[1:]:\n"
        "    print(json.dumps([d.to_json() for d in analyze(compile_file(path))]))\n"
    )
    outputs = set()
    for seed in ("1", "2", "3"):  # set and dict order must not leak into the output
        done = subprocess.run(
            [sys.executable, "-c", script, *map(str, paths)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=HANG_S,
        )
        assert done.returncode == 0, done.stderr
        outputs.add(done.stdout)
    assert len(outputs) == 1
    assert all(json.loads(line) for line in outputs.pop().splitlines())


def test_cli_exit_codes(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from jobrun.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent(CLEAN.replace("in: [total], msg", "in: [ghost], msg")))
    good = tmp_path / "good.yaml"
    good.write_text(textwrap.dedent(CLEAN))
    result = CliRunner().invoke(main, ["analyze", str(good)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["analyze", str(bad), "--format", "json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["errors"] == 1 and report["diagnostics"][0]["code"] == "undefined-blob"


# -- no torch, speed -----------------------------------------------------------------------


def test_analyze_never_imports_torch() -> None:
    script = (
        "import sys, glob\n"
        "from jobrun.plans.compile import compile_file\n"
        "from jobrun.plans.analyze import analyze\n"
        "for p in sorted(glob.glob('plans/*.yaml')):\n"
        "    analyze(compile_file(p))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _chain_plan(n: int) -> ir.Plan:
    """One private epoch task: x0 = const; x{i} = add(x{i-1}, 1); built as IR (no YAML)."""
    f = "gen.yaml"
    steps: list[ir.Step] = [
        ir.OpCall("const", (), (ir.BlobRef("x0", Pos(f, 2, 1)),), (("value", 0),), Pos(f, 2, 1))
    ]
    for i in range(1, n):
        p = Pos(f, i + 2, 1)
        steps.append(
            ir.OpCall(
                "add",
                (ir.BlobRef(f"x{i - 1}", p), ir.Literal(1, p)),
                (ir.BlobRef(f"x{i}", p),),
                (),
                p,
            )
        )
    top = Pos(f, 1, 1)
    task = ir.Task(
        "chain",
        "epoch",
        "local",
        "private",
        1,
        (),
        tuple(steps),
        (),
        (ir.BlobRef(f"x{n - 1}", top),),
        top,
    )

    def group(name: str, tasks: tuple[ir.Task, ...] = ()) -> ir.Group:
        return ir.Group(name, tasks, top)

    return ir.Plan(
        "gen",
        0,
        "cpu",
        1,
        {},
        1,
        (),
        None,
        group("init"),
        group("epoch", (task,)),
        group("download"),
        group("exit"),
        f,
        top,
    )


@pytest.mark.slow  # 4-5 s: a scale test, not for the fast tier
def test_a_hundred_thousand_ops_chain_is_clean() -> None:
    # Its speed is measured in benchmarks/ (plan scale), not here.
    assert analyze(_chain_plan(100_000)) == []


def test_an_unread_train_step_loss_is_one_warning_not_two() -> None:
    """`<loss>_last`, which train.step also writes and the plan never names, was warned of
    beside the loss itself, with the hint to remove the step that defines it."""
    text = """
job: j
max_epochs: 1
init:
  - task: setup
    do:
      - model.mlp: {out: model, sizes: [2, 2]}
      - optimizer: {in: model, out: opt}
      - randn: {out: x, shape: [4, 2]}
      - const: {out: y, value: [0, 1, 0, 1]}
epoch:
  - task: train
    do:
      - train.step: {in: [model, opt, x, y], out: loss}
"""
    found = [(d.code, d.message) for d in run(text) if d.code == "unused"]
    assert found == [("unused", "blob 'loss' is defined but never read in private task 'train'")]
