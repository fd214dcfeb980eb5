"""Arithmetic in `${...}`: Python's numbers and types, no eval, errors at file:line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrun.errors import PlanError, Pos
from jobrun.plans import arith
from jobrun.plans.load import load_text
from jobrun.plans.resolve import substitute

F = "plan.yaml"


def subst(text: str):
    return substitute(load_text(text, F), {"plan_dir": "/plans", "run_dir": "/runs/x"})


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("steps - warmup", 270),
        ("steps-warmup", 270),
        ("batch * 2", 64),
        ("steps / 100", 3.0),
        ("steps // 100", 3),
        ("steps % 7", 300 % 7),
        ("-warmup + 1", -29),
        ("(steps - warmup) // 10 * 2", 54),
        ("lr * 0.5", 0.0015),
        ("lr * batch", 0.003 * 32),
        ("2 + 3 * 4", 14),
        ("-(-3)", 3),
        ("+warmup", 30),
        ("1e3 // 7", 1e3 // 7),
        ("-7 // 2", -4),
        ("-7 % 3", 2),
    ],
)
def test_arithmetic_gives_pythons_value_and_type(expr, value):
    t = subst(f"vars: {{steps: 300, warmup: 30, batch: 32, lr: 0.003}}\nv: '${{{expr}}}'\n")
    assert t["v"] == value and type(t["v"]) is type(value)


def test_arithmetic_inside_a_longer_string_and_in_vars():
    t = subst("vars: {steps: 300, warmup: 30, decay: '${steps - warmup}'}\n"
              "name: 'run-${decay // 10}'\nd: '${decay}'\n")
    assert t["name"] == "run-27" and t["d"] == 270 and t["vars"]["decay"] == 270


@pytest.mark.parametrize(
    ("text", "pos", "message", "hint"),
    [
        ("vars: {a: 1}\nv: '${a / 0}'\n", Pos(F, 2, 4), "divides by zero", "check"),
        ("vars: {a: 1}\nv: '${a % (a - 1)}'\n", Pos(F, 2, 4), "divides by zero", "check"),
        ("vars: {a: 1}\nv: '${a ** 2}'\n", Pos(F, 2, 4), "Pow is not allowed", "+ - * /"),
        ("vars: {a: 1}\nv: '${a + b}'\n", Pos(F, 2, 4), "undefined variable ${b}", "known: a"),
        ("vars: {a: x}\nv: '${a * 2}'\n", Pos(F, 2, 4), "var 'a' is the string 'x', not a number",
         "hold numbers"),
        ("vars: {a: true}\nv: '${a + 1}'\n", Pos(F, 2, 4), "is a boolean", "numbers"),
        ("vars: {a: {b: 1}}\nv: '${a + 1}'\n", Pos(F, 2, 4), "var 'a' is a mapping, not a number", "numbers"),
        ("v: '${__import__(\"os\").getcwd()}'\n", Pos(F, 1, 4), "a function call is not allowed", "+ - *"),
        ("v: '${(1).real}'\n", Pos(F, 1, 4), "an attribute is not allowed", "+ - *"),
        ("v: '${1 +}'\n", Pos(F, 1, 4), "cannot read ${1 +} as arithmetic", "+ - *"),
        ("v: '${\"a\" + \"b\"}'\n", Pos(F, 1, 4), "'a' is not a number", "+ - *"),
        ("v: '${1 < 2}'\n", Pos(F, 1, 4), "Compare is not allowed", "+ - *"),
        ("v: '${10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10 * 10}'\n",
         Pos(F, 1, 4), "too long", "var of its own"),
        ("vars: {a: 1.0e300}\nv: '${a * a}'\n", Pos(F, 2, 4), "gives inf", "check"),
    ],
)
def test_bad_arithmetic_is_one_error_at_the_value(text, pos, message, hint):
    with pytest.raises(PlanError) as info:
        subst(text)
    e = info.value
    assert e.pos == pos, e.format_message()
    assert message in e.message and hint in (e.hint or ""), e.format_message()


def test_huge_integers_are_refused():
    big = " * ".join(["n"] * 30)
    with pytest.raises(PlanError, match="bits"):
        subst(f"vars: {{n: 1000000000000}}\nv: '${{{big}}}'\n")


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6),
       st.sampled_from(["+", "-", "*", "/", "//", "%"]))
def test_agrees_with_python(a, b, op):
    expr = f"a {op} b"
    env = {"a": a, "b": b}
    try:
        expect = {"+": a + b, "-": a - b, "*": a * b}.get(op)
        if expect is None:
            expect = {"/": lambda: a / b, "//": lambda: a // b, "%": lambda: a % b}[op]()
    except ZeroDivisionError:
        with pytest.raises(arith.ArithError, match="divides by zero"):
            arith.evaluate(expr, env.__getitem__)
        return
    got = arith.evaluate(expr, env.__getitem__)
    assert got == expect and type(got) is type(expect)


def test_a_plan_compiles_with_arithmetic_where_an_int_is_expected(tmp_path):
    from jobrun.plans.compile import compile_text

    plan = compile_text(
        "job: a\nvars: {epochs: 4, extra: 2}\nmax_epochs: '${epochs + extra}'\n"
        "epoch:\n  - task: t\n    do:\n      - loop: '${epochs * 2}'\n        do: []\n",
        str(tmp_path / "p.yaml"),
    )
    assert plan.max_epochs == 6
