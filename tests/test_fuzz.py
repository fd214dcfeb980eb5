"""Fuzzing the plan front end: any text either compiles or fails with a JobrunError.

Random YAML-ish text and random mutations of the example plans go through the whole
front end (load, --set, substitution, compile, analyze, print). A RecursionError,
KeyError, TypeError... anywhere is a bug: the user would see a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from jobrun.errors import JobrunError, Pos
from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_tree
from jobrun.plans.keys import CHECKPOINT_KEYS, TASK_KEYS, TOP_KEYS
from jobrun.plans.load import PList, PMap, load_text, to_plain
from jobrun.plans.printer import render_json, render_text

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {p.name: p.read_text() for p in sorted((ROOT / "plans").glob("*.yaml"))}

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def front_end(text: str, sets: list[str] | None = None) -> None:
    """Run everything `jobrun print`/`analyze` run; only JobrunError may escape."""
    try:
        tree = load_text(text, "fuzz.yaml")
        _check_positions(tree, len(text.splitlines()) + 1)  # YAML breaks lines at \r, \x85... too
        plan = compile_tree(tree, "fuzz.yaml", sets or [])
    except JobrunError as e:
        event(f"refused: {type(e).__name__}")
        return
    event("compiled")
    json.dumps(to_plain(tree), default=str)
    for d in analyze(plan):
        assert d.severity in ("error", "warning") and d.pos is not None and d.message
    assert isinstance(render_text(plan), str)
    assert isinstance(render_text(plan, factor_prefixes=True), str)
    json.dumps(render_json(plan))


def _check_positions(value: object, lines: int) -> None:
    """Every container, key, value and item of a loaded tree has a place in the text."""
    def inside(pos: Pos) -> bool:
        return pos.file == "fuzz.yaml" and 1 <= pos.line <= lines and pos.col >= 1

    if isinstance(value, PMap):
        assert inside(value.pos) and list(value.key_pos) == list(value) == list(value.val_pos)
        assert all(inside(value.key_at(k)) and inside(value.at(k)) for k in value)
        for v in value.values():
            _check_positions(v, lines)
    elif isinstance(value, PList):
        assert inside(value.pos) and len(value.item_pos) == len(value)
        assert all(inside(p) for p in value.item_pos)
        for v in value:
            _check_positions(v, lines)
    else:
        assert not isinstance(value, dict | list), type(value)


# -- (a) YAML-ish text -------------------------------------------------------------------

STEP_KEYS = ("loop", "as", "stop_if", "if", "then", "elif", "else", "parallel", "report", "name")
OP_WORDS = ("add", "mul", "const", "fill", "copy", "log", "read", "reader", "save", "call", "ge")
ARG_KEYS = ("in", "out", "value", "shape", "msg", "path", "fn", "batch_size")
KEYS = TOP_KEYS + TASK_KEYS + CHECKPOINT_KEYS + STEP_KEYS + OP_WORDS + ARG_KEYS
SCALARS = (
    "0", "1", "3", "-1", "1.5", "1e3", "1.0e+400", ".nan", ".inf", "-.inf", "true", "no", "on",
    "null", "~", "''", '""', "abc", "a/b", "../x", "enc/w", "1x", "500ms", "2s", "fast",
    "2024-05-01", "0x1F", "1_000", "1:30", "${lr}", "$${x}", "${plan_dir}", "${nope}",
    "'${lr}'", "\"${lr}\"", "auto", "cuda:0", "global", "private", "é", "日本", "\U0001f600",
    "9" * 30, "=", "<<", "a b", "'a: b'",
)
TOKENS = (
    ": ", ":", "- ", "-", "[", "]", "{", "}", ", ", ",", "&a ", "*a", "&b ", "*b", "!!str ",
    "!!int ", "!!set ", "!!binary ", "!!python/object/apply:os.system ", "!tag ", "? ", "<<: ",
    "# c", "---", "...", "|", ">", "'", '"', "\t", " ", "  ", "%YAML 1.1", "\\", "\ufeff",
)

token = st.one_of(
    st.sampled_from(TOKENS),
    st.sampled_from(KEYS).map(lambda k: k + ": "),
    st.sampled_from(SCALARS),
    st.text(min_size=1, max_size=4),
)
line = st.tuples(st.integers(0, 12), st.lists(token, max_size=8)).map(
    lambda t: " " * t[0] + "".join(t[1])
)
yamlish = st.lists(line, max_size=30).map("\n".join)


@FUZZ
@given(yamlish)
@example("job: j\nmax_epochs: 1\nepoch: [{task: t, do: [{loop: 2, as: i, do: [{stop_if: i}]}]}]\n")
@example("a: &a [*a]\n")
@example("job: j\nvars: {a: &x [1]}\nmax_epochs: 1\nepoch: [{task: t, do: [{const: {out: z, value: *x}}]}]\n")
def test_yamlish_text(text: str) -> None:
    front_end(text)


def _plan(steps: str) -> str:
    return f"job: j\nmax_epochs: 2\nepoch:\n  - task: t\n    do: {steps}\n    outputs: [a]\n"


# Structured plans reach the compiler and analyzer far more often than random text.
blob = st.sampled_from(("a", "b", "i", "done", "enc/w", "1x", "a b", ""))
value = st.one_of(
    blob, st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(), st.none(), st.lists(blob, max_size=3),
)
op_call = st.builds(
    lambda op, ins, out, extra: {op: {"in": ins, "out": out, **extra}},
    st.sampled_from(OP_WORDS + ("nope", "train.step", "data.synthetic")),
    st.one_of(value, st.lists(value, max_size=3)),
    st.one_of(blob, st.lists(blob, max_size=3), st.none()),
    st.dictionaries(st.sampled_from(ARG_KEYS + ("shape", "dtype", "task")), value, max_size=2),
)
steps = st.recursive(
    st.lists(op_call, max_size=3),
    lambda inner: st.lists(
        st.one_of(
            op_call,
            st.builds(lambda n, body: {"loop": n, "as": "i", "do": body}, st.one_of(st.integers(-1, 3), blob, st.none()), inner),
            st.builds(lambda c, t, e: {"if": c, "then": t, "else": e}, blob, inner, inner),
            st.builds(lambda c, t: {"if": "a", "then": t, "elif": [{"if": c, "then": t}]}, blob, inner),
            st.builds(lambda a, b: {"parallel": [{"do": a}, {"name": "x", "do": b}]}, inner, inner),
            st.builds(lambda p, body: {"report": p, "do": body}, st.sampled_from(("5ms", "2s", "0s", "x", 5)), inner),
            st.builds(lambda c: {"stop_if": c}, blob),
        ),
        max_size=3,
    ),
    max_leaves=12,
)


@FUZZ
@given(steps)
def test_structured_steps(body: list) -> None:
    front_end(_plan(json.dumps(body)))


# -- (b) mutations of the example plans --------------------------------------------------

REPLACEMENTS = ("[]", "{}", "null", "[a, 1]", "{x: 1}", "''", "3", "-1", "true", "x y", "${lr}", "[[[]]]")


@st.composite
def mutated_plan(draw: st.DrawFn) -> tuple[str, list[str]]:
    name = draw(st.sampled_from(sorted(EXAMPLES)))
    lines = EXAMPLES[name].splitlines()
    for _ in range(draw(st.integers(1, 4))):
        if not lines:
            lines = ["job: j"]
        i = draw(st.integers(0, len(lines) - 1))
        j = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(
            ("delete", "duplicate", "swap", "scalar", "indent", "insert", "replace", "truncate")
        ))
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(j, lines[i])
        elif kind == "swap":
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "scalar":
            head, sep, _ = lines[i].rpartition(": ")
            new = draw(st.one_of(st.sampled_from(SCALARS), st.text(max_size=5)))
            lines[i] = head + sep + new if sep else new
        elif kind == "indent":
            delta = draw(st.integers(-4, 4))
            stripped = lines[i].lstrip(" ")
            lines[i] = " " * max(0, len(lines[i]) - len(stripped) + delta) + stripped
        elif kind == "insert":
            key = draw(st.sampled_from(KEYS))
            val = draw(st.sampled_from(SCALARS + REPLACEMENTS))
            lines.insert(i, " " * draw(st.integers(0, 10)) + f"{key}: {val}")
        elif kind == "replace":
            head, sep, _ = lines[i].partition(": ")
            if sep:
                lines[i] = head + sep + draw(st.sampled_from(REPLACEMENTS))
        else:
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
    sets = draw(st.lists(
        st.sampled_from((
            "max_epochs=2", "vars.lr=0.5", "epoch.0.do.0.loop=3", "seed=x", "stop_when=[]",
            "epoch.0.task=other", "vars=[]", "epoch.0.do=null", "init.0.do.0=null",
        )),
        max_size=2,
    ))
    return "\n".join(lines) + "\n", sets


@FUZZ
@given(mutated_plan())
def test_mutated_examples(case: tuple[str, list[str]]) -> None:
    text, sets = case
    front_end(text, sets)


def test_examples_compile_cleanly() -> None:
    # The mutations above start from plans that work: make sure they do.
    assert EXAMPLES
    for name, text in EXAMPLES.items():
        tree = load_text(text, name)
        plan = compile_tree(tree, name)
        errors = [d.format() for d in analyze(plan) if d.severity == "error"]
        assert not errors, f"{name}: {errors}"
