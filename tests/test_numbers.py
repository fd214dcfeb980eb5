"""Numbers as users write them (YAML 1.2), and comparisons of a number with a string.

The loader's corner cases are in test_load.py; here: what a user's commands do with them.
"""

from __future__ import annotations

import json
import math

import pytest
from runner_util import jobrun, logged

from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_text

FILE = "t.yaml"

# A threshold written as a user writes it. With YAML 1.1 `1e30` was the string '1e30':
# `analyze` said ok and the run failed comparing a float with a str.
THRESHOLD = """\
job: thresholds
max_epochs: 3
vars: {target: 1e30, floor: -.inf, step: 1E-3}
init:
  - task: setup
    do:
      - const: {out: target, value: "${target}"}
      - const: {out: best, value: .inf}
epoch:
  - task: train
    do:
      - const: {out: loss, value: 2.5e-1}
      - lt: {in: [loss, target], out: below}
      - gt: {in: [loss, "${floor}"], out: above}
      - lt: {in: [loss, best], out: better}
      - mul: {in: [loss, "${step}"], out: scaled}
      - log: {in: [below, above, better, scaled]}
    outputs: [below]
"""


def test_exponents_and_infinities_are_floats_through_analyze_and_a_run(plan_file, tmp_path) -> None:
    path = plan_file(THRESHOLD)
    r = jobrun("analyze", path)
    assert r.code == 0, r.text
    assert "ok" in r.err
    plan = compile_text(THRESHOLD, FILE)
    assert plan.vars == {"target": 1e30, "floor": -math.inf, "step": 0.001}
    r = jobrun("train", path, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    values = logged(tmp_path / "run")
    assert [v["below"] for v in values] == [True] * 3
    assert values[0]["above"] is True and values[0]["better"] is True
    assert values[0]["scaled"] == pytest.approx(0.25e-3)


def test_print_writes_infinities_as_the_plan_does(plan_file) -> None:
    path = plan_file(THRESHOLD)
    r = jobrun("print", path)
    assert r.code == 0, r.text
    assert "best = const(value=.inf)" in r.out
    assert "above = gt(loss, -.inf)" in r.out
    r = jobrun("print", path, "--format", "json")
    data = json.loads(r.out, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert data["vars"]["floor"] == "-.inf"
    do = data["groups"][1]["tasks"][0]["do"]
    assert do[2]["in"] == ["loss", "-.inf"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1e-4", 0.0001), ("1E5", 100000.0), (".inf", math.inf), ("-.inf", -math.inf), ("+1.5e3", 1500.0)],
)
def test_overrides_read_numbers_the_same_way(value: str, expected: float) -> None:
    plan = compile_text(THRESHOLD, FILE, sets=[f"vars.target={value}"])
    assert plan.vars["target"] == expected and type(plan.vars["target"]) is float


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("vars: {x: .nan}", ".nan (not a number) cannot be a plan value"),
        ("vars: {x: 007}", "007 is ambiguous"),
        ("vars: {x: 1e999}", "too large for a number"),
    ],
)
def test_numbers_a_plan_cannot_hold_are_refused_with_their_place(plan_file, text: str, words: str) -> None:
    path = plan_file(THRESHOLD.replace("vars: {target: 1e30, floor: -.inf, step: 1E-3}", text))
    r = jobrun("analyze", path)
    assert r.code == 2 and f"{path}:3:" in r.err and words in r.err, r.text
    assert "Traceback" not in r.text


# -- comparisons of a number with a string -------------------------------------------------

COMPARE = """\
job: compare
max_epochs: 2
vars: {target: "1e-4", mode: train, limit: 3}
init:
  - task: setup
    do:
      - const: {out: target, value: "${target}"}
      - const: {out: mode, value: "${mode}"}
      - const: {out: limit, value: "${limit}"}
epoch:
  - task: t
    do:
      - const: {out: loss, value: 0.5}
      - STEP
    outputs: [out]
"""


def diagnose(step: str, text: str = COMPARE) -> list:
    return analyze(compile_text(text.replace("STEP", step), FILE))


def line_col(text: str, token: str) -> tuple[int, int]:
    """Where `token` first appears in the epoch group."""
    lines = text.splitlines()
    start = lines.index("epoch:")
    for number, line in enumerate(lines[start:], start + 1):
        if token in line:
            return number, line.index(token) + 1
    raise AssertionError(token)


@pytest.mark.parametrize(
    ("step", "token", "words", "hint"),
    [
        # the case: a threshold quoted by mistake, through a var
        ("lt: {in: [loss, target], out: out}", "target]", ("`lt` compares `loss` (the number 0.5",
         "`target` (the string '1e-4', line 7)", "cannot be ordered"), "write it without quotes"),
        ("eq: {in: [mode, 1], out: out}", "mode,", ("`eq` compares the number 1 with `mode`",
         "never equal"), "needs two numbers or two strings"),
        ("ne: {in: [limit, mode], out: out}", "mode]", ("always unequal",), "quote the value at line 9"),
        ("ge: {in: [loss, 1], out: flag}\n      - ge: {in: [flag, mode], out: out}", "mode]",
         ("a boolean from `ge`",), "give `mode`"),
    ],
)
def test_a_number_compared_with_a_string_is_an_error(step: str, token: str, words: tuple, hint: str) -> None:
    diags = diagnose(step)
    errors = [d for d in diags if d.severity == "error"]
    assert [d.code for d in errors] == ["compare-types"], "\n".join(d.format() for d in diags)
    d = errors[0]
    text = COMPARE.replace("STEP", step)
    assert (d.pos.file, d.pos.line, d.pos.col) == (FILE, *line_col(text, token)), d.format()
    for word in words:
        assert word in d.message, d.format()
    assert hint in d.hint, d.format()


def test_a_loop_index_is_a_number() -> None:
    step = "loop: 2\n        as: i\n        do:\n          - gt: {in: [i, mode], out: out}\n      - const: {out: out, value: 1}"
    d = [d for d in diagnose(step) if d.code == "compare-types"]
    assert len(d) == 1 and "`i` (a loop index)" in d[0].message


def test_ordering_an_unknown_value_against_a_quoted_number_is_a_warning() -> None:
    # `evaluate`'s loss is only known when the job runs; '1e-4' can only be meant as a number.
    text = COMPARE.replace("const: {out: loss, value: 0.5}", 'call: {fn: "math:sqrt", in: [limit], out: loss}')
    d = [d for d in diagnose("lt: {in: [loss, target], out: out}", text) if d.code == "compare-types"]
    assert len(d) == 1 and d[0].severity == "warning", d
    assert "if `loss` holds a number" in d[0].message and "without quotes" in d[0].hint


@pytest.mark.parametrize(
    "step",
    [
        "eq: {in: [mode, mode], out: out}",  # two strings
        "lt: {in: [loss, limit], out: out}",  # two numbers
        'call: {fn: "math:sqrt", in: [limit], out: u}\n      - eq: {in: [u, mode], out: out}',  # unknown
        # a blob that is a string on one path and a number on another is not judged
        "const: {out: mode, value: 2}\n      - lt: {in: [loss, mode], out: out}",
        # ... or that another op (whose result is unknown) defines too
        'call: {fn: "math:sqrt", in: [limit], out: mode}\n      - eq: {in: [mode, 1], out: out}',
    ],
)
def test_no_finding_where_the_kinds_are_not_a_number_and_a_string(step: str) -> None:
    assert [d for d in diagnose(step) if d.code == "compare-types"] == []


LOOP = "job: j\nmax_epochs: 1\nepoch:\n  - task: t\n    do:\n      DEFS\n      - loop: n\n        do: [{log: {in: [n]}}]\n"


@pytest.mark.parametrize("value", ["-2", "2.5", "'3'", "true", "null", "[1, 2]", "[2.5]"])
def test_a_const_that_is_no_loop_count_is_an_error_at_the_count(value: str) -> None:
    (d,) = analyze(compile_text(LOOP.replace("DEFS", f"- const: {{out: n, value: {value}}}"), FILE))
    assert (d.severity, d.code, d.pos.line, d.pos.col) == ("error", "loop-count", 7, 15), d.format()
    assert "loop count `n` (" in d.message and "line 6) is not a whole number >= 0" in d.message
    assert d.hint == "give the `const` at line 6 a whole number >= 0, e.g. value: 3"


@pytest.mark.parametrize(("defs", "severities"), [
    ("- const: {out: n, value: 3}", []),
    ("- const: {out: n, value: [3]}", []),  # a one-element tensor will do
    ("- const: {out: n, value: [[3]]}", []),
    ("- const: {out: n, value: -2}\n      - add: {in: [n, 5], out: n}", []),  # the add's value is not known
    ("- const: {out: n, value: -2}\n      - const: {out: n, value: 2}", ["warning"]),  # one of two
])
def test_loop_counts_judged_only_where_every_definition_is_known(defs: str, severities: list) -> None:
    diags = analyze(compile_text(LOOP.replace("DEFS", defs), FILE))
    assert [d.severity for d in diags if d.code == "loop-count"] == severities


def test_analyze_cli_reports_the_comparison_with_its_place(plan_file) -> None:
    path = plan_file(COMPARE.replace("STEP", "lt: {in: [loss, target], out: out}"))
    r = jobrun("analyze", path)
    assert r.code == 1
    assert f"{path}:14:" in r.out and "error: `lt` compares" in r.out
    r = jobrun("train", path, "--run-dir", path.parent / "run")
    assert r.code == 2 and "cannot be ordered" in r.err and not (path.parent / "run").exists()

