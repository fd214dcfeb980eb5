"""The fast loader builds exactly the tree the exact (libyaml) loader builds, or steps aside.

Every check here compares the two on the same text: the values and their types, the
kind of every container, and every position (which the fast tree works out lazily from
the exact parse). Texts come from the example plans, the broken-plan corpus, the
benchmark's generated plan, hand-picked corner cases and hypothesis.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobrun.errors import JobrunError, PlanError, Pos
from jobrun.plans import fastyaml, load
from jobrun.plans.compile import compile_text, compile_tree
from jobrun.plans.tree import LazyPos, PList, PMap

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "plans").glob("*.yaml")) + sorted((ROOT / "tests" / "plans").glob("*.yaml"))
CORPUS = sorted((ROOT / "tests" / "bad_plans").glob("*.yaml"))


def fast(text: str, name: str = "t.yaml") -> PMap | None:
    b = load._Builder(name)
    if load._BAD_CHAR.search(text):
        return None
    return fastyaml.parse(
        text, name, b.resolve_plain, load._exact,
        max_depth=load.MAX_DEPTH, max_nodes=load.MAX_NODES, bad=load._Bad,
    )


def exact(text: str, name: str = "t.yaml") -> Any:
    """The exact loader's tree, or the PlanError it raises."""
    try:
        return load._Builder(name).build(text)[0]
    except PlanError as e:
        return e


def same(a: Any, b: Any, path: str = "") -> None:
    """Equal values of equal types, containers of the same kind, everywhere."""
    if isinstance(b, dict):
        assert isinstance(a, PMap) and isinstance(b, PMap), path
        assert list(a) == list(b), path
        for k in b:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(b, list):
        assert isinstance(a, PList) and isinstance(b, PList), path
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b), (path, a, b)
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (path, a, b)


def same_positions(a: Any, b: Any) -> None:
    """Every position of the fast tree, resolved lazily, is the exact tree's."""
    if isinstance(b, dict):
        assert a.pos == b.pos
        for k in b:
            assert a.at(k) == b.at(k) and a.key_at(k) == b.key_at(k), k
            same_positions(a[k], b[k])
    elif isinstance(b, list):
        assert a.pos == b.pos
        for i in range(len(b)):
            assert a.at(i) == b.at(i), i
            same_positions(a[i], b[i])


def check(text: str) -> str:
    """'fast' when the fast loader took `text` (and agreed), 'exact' when it stepped aside."""
    f = fast(text)
    e = exact(text)
    if f is None:
        return "exact"
    assert not isinstance(e, PlanError), f"fast loader took text the exact loader refuses: {e}"
    same(f, e)
    return "fast"


# -- the files the project ships and tests --------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_plans_take_the_fast_path_and_agree(path: Path) -> None:
    text = path.read_text()
    f, e = fast(text, str(path)), exact(text, str(path))
    assert f is not None, "an example plan should not need the slow loader"
    same(f, e)
    same_positions(f, e)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_broken_plans_agree_or_step_aside(path: Path) -> None:
    text = path.read_bytes().decode("utf-8", "replace")
    check(text)


def test_generated_benchmark_plan_takes_the_fast_path() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.bench_plans import plan_text
    finally:
        sys.path.remove(str(ROOT))
    text = plan_text(2000)
    assert check(text) == "fast"
    f, e = fast(text), exact(text)
    same_positions(f, e)


# -- corner cases --------------------------------------------------------------------------

CORNERS = [
    # scalars YAML 1.1 reads as something other than a string
    "a: [yes, No, on, OFF, true, null, Null, ~, y, n]",
    "a: {b: 1e5, c: 1.5e+5, d: 1.0e5, e: 0x1f, f: 0o7, g: 017, h: 1_000, i: 1:30, j: .5, k: -0, l: +1}",
    "a: [1., -1.5, 12345678901234567890, 9223372036854775807, 2020-01-01, .inf, .nan, -.inf]",
    "a: yes\nb: 1e5\nc: 0x1f\nd: 1:30\ne: ~\nf: 2020-01-01\ng: 1.5\nh: -x",
    # words next to the quoting rules of the fast path
    "a: [b0_a/x.y-z, $x, a$b, _, __init__, yes_no, truex, nullable]",
    "a: [a b, c  d, 500ms, 2s, 3d, é, αβ, 'x y', \"z w\"]",
    "a: {in: [x, 1], out: y}  # a comment\n",
    "a: {b: c #d}",
    "a: [b, c] # c\nd: [e]#f",
    "a: {b:c}",
    "a: {b: c, d:[e]}",
    "a: {b:? c: d}",
    "a: [b:?c, d:e]",
    "a: {b:{c: 1}}",
    'a: {"b":[1], "c" :2}',
    "a: [\"b\":1]",
    "a: {b: c:d}",
    "a: {'b': c, \"d\": e}",
    "a: {b: 'it''s'}",
    'a: {b: "x\\ty"}',
    "a: {b: , c: d}",
    "a: [b, ]",
    "a: {b}",
    "a: [b: c]",
    "a: {b: c, b: d}",
    "a: {<<: {b: c}}",
    "a: [[1, [2, [3]]], {}, []]",
    "a: [b, c], [d]",
    "a: [b\n  , c]",
    "a: [&x b, *x]",
    "a: [!!str 1]",
    # block structure
    "a:\n- b\n- c\nd: e",
    "a:\n  - b: 1\n    c: 2\n  - d\n",
    "- a\n- b\n",
    "a: 1\n  b: 2\n",
    "a:\n  b: 1\n c: 2\n",
    "a: b\n   c\n",
    "a:\n  - - b\n",
    "a: |\n  text\n",
    "a: >\n  text\n",
    "a: 1\na: 2\n",
    "'a': 1\n\"b\": 2\nc d: 3\n",
    "a:\n  b:\n  c:\n",
    "a: -\n",
    "a: - b\n",
    "a:\n  -\n  - b\n",
    "  a: 1\n  b: 2\n",
    "---\na: 1\n",
    "a: 1\n---\nb: 2\n",
    "a: 1\n...\n",
    "%YAML 1.1\n---\na: 1\n",
    "a: 1\r\nb: 2\r\n",
    "a:\tb\n",
    "\ufeffa: 1\n",
    "a: b: c\n",
    "a: x:y\n",
    "a: b #c\n",
    "a: b#c\n",
    "a: 'b' #c\n",
    "a: \"b\" c\n",
    "a: ${x}\nb: \"${y}\"\nc: [\"${z}\", w]\n",
    "a: {b: ${x}}\n",
    "? a\n: b\n",
    "a: @b\n",
    "a: `b`\n",
    "a: !b c\n",
    "<<: {a: 1}\n",
    "",
    "# only a comment\n",
    "a",
    "[a, b]",
]


@pytest.mark.parametrize("text", CORNERS)
def test_corner_cases_agree_or_step_aside(text: str) -> None:
    check(text)


def test_common_corners_take_the_fast_path() -> None:
    # Not only correct: these are what plans are made of, so they must stay fast.
    for text in (
        "a: [yes, No, on, OFF, true, null, Null, ~, y, n]",
        "a: [b0_a/x.y-z, $x, a$b, _, __init__, yes_no, truex, nullable]",
        "a: {in: [x, 1], out: y}  # a comment\n",
        "a:\n- b\n- c\nd: e",
        "a: ${x}\nb: \"${y}\"\nc: [\"${z}\", w]\n",
        "a: [1., -1.5, 9223372036854775807]",
    ):
        assert check(text) == "fast", text


def test_words_yaml_reads_as_booleans_or_null_are_exactly_the_special_words() -> None:
    # The fast path quotes every name-like word except these: if PyYAML ever read
    # another identifier as a non-string, this fails.
    resolvers = load._RESOLVERS
    candidates = set(fastyaml._SPECIAL) | {
        w for c in resolvers for w in (c, c * 2, c + "es", c + "ull", c + "rue", c + "alse", c + "n", c + "ff")
    }
    special = set()
    for word in candidates:
        if not word.isidentifier():
            continue
        tag = next((t for t, rx in resolvers.get(word[:1], ()) if rx.match(word)), None)
        if tag is not None:
            special.add(word)
    assert special == set(fastyaml._SPECIAL)


# -- generated text ----------------------------------------------------------------------

SCALARS = st.sampled_from([
    "a", "b0_c/d", "x.y", "yes", "No", "on", "true", "null", "~", "1", "-1", "0", "1.5", "1.",
    ".5", "1e5", "1.0e+5", "0x10", "017", "1_000", "1:20", "2020-01-01", ".inf", ".nan",
    "12345678901234567890", "'q'", "'q r'", '"d"', '"d e"', '"${v}"', "${v}", "a b", "$x",
    "é", "-x", "- x", ":x", "a:b", "a: b", "#c", "a #c", "a#c", "&x a", "*x", "!t a", "''",
    '""', "[]", "{}", "@a", "%a", "a,b",
])
KEYS = st.sampled_from(["a", "b", "in", "out", "'q'", '"d"', "on", "1", "a b", "<<", "k:"])


@st.composite
def flow(draw: Any, depth: int = 0) -> str:
    if depth > 2 or draw(st.booleans()):
        return draw(SCALARS)
    n = draw(st.integers(0, 3))
    sep = draw(st.sampled_from([", ", ",", " , "]))
    if draw(st.booleans()):
        return "[" + sep.join(draw(flow(depth + 1)) for _ in range(n)) + "]"
    return "{" + sep.join(f"{draw(KEYS)}: {draw(flow(depth + 1))}" for _ in range(n)) + "}"


@st.composite
def block(draw: Any, indent: int = 0, depth: int = 0) -> str:
    lines = []
    pad = " " * indent
    if draw(st.booleans()) or depth > 2:
        for _ in range(draw(st.integers(1, 3))):
            key = draw(KEYS)
            kind = draw(st.integers(0, 3)) if depth <= 2 else 0
            if kind == 0:
                lines.append(f"{pad}{key}: {draw(flow())}")
            else:
                step = draw(st.sampled_from([0, 1, 2, 4]))
                lines.append(f"{pad}{key}:" + draw(st.sampled_from(["", "  # c"])))
                lines.append(draw(block(indent + step, depth + 1)))
    else:
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                lines.append(f"{pad}- {draw(flow())}")
            else:
                inner = draw(block(indent + 2, depth + 1))
                lines.append(f"{pad}- " + inner.lstrip(" ") if inner.strip() else f"{pad}-")
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(["", "# note", "   ", "  # x"])))
    return "\n".join(lines)


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(block())
def test_generated_yaml_agrees_or_steps_aside(text: str) -> None:
    check(text)


@FUZZ
@given(st.sampled_from([p.read_text() for p in EXAMPLES]), st.data())
def test_mutated_example_plans_agree_or_step_aside(text: str, data: st.DataObject) -> None:
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        piece = data.draw(st.sampled_from([
            " ", "  ", "-", ":", ": ", "#", "'", '"', "[", "]", "{", "}", ",", "\n", "x", "1", "&", "*",
            "~", "!", "?", "|", ">", "%", "@", "`", "$", "e5", ".", "_", "\\", "yes", "é",
        ]))
        text = text[:i] + piece + text[i + data.draw(st.integers(0, 2)):]
    check(text)


# -- positions through the rest of the front end ---------------------------------------


def errors_both_ways(text: str, sets: list[str] | None = None, monkeypatch: Any = None) -> tuple[str, str]:
    """The compile error of `text`, loaded fast and loaded exactly."""
    def run() -> str:
        try:
            compile_text(text, "p.yaml", sets or [])
        except JobrunError as e:
            return e.format_message()
        return "ok"

    with_fast = run()
    monkeypatch.setattr(fastyaml, "parse", lambda *a, **k: None)
    with_exact = run()
    monkeypatch.undo()
    return with_fast, with_exact


@pytest.mark.parametrize("path", [p for p in CORPUS if "expect: 2" in p.read_text(errors="replace")],
                         ids=lambda p: p.name)
def test_compile_errors_are_the_same_with_either_loader(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = path.read_bytes().decode("utf-8", "replace")
    a, b = errors_both_ways(text, monkeypatch=monkeypatch)
    assert a == b


def test_errors_in_substituted_vars_and_set_values_point_at_the_same_place(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = (
        "job: j\nvars:\n  outs: [ok, 9bad]\nepoch:\n  - task: t\n    do:\n"
        "      - add: {in: [a, 1], out: \"${outs}\"}\n"
    )
    a, b = errors_both_ways(plan, monkeypatch=monkeypatch)
    assert a == b and "p.yaml:3:" in a and "9bad" in a
    a, b = errors_both_ways(plan.replace("9bad", "ok2"), ["epoch.0.do.0.add.out=7"], monkeypatch=monkeypatch)
    assert a == b and "--set" in a


def test_positions_are_worked_out_only_when_asked_for() -> None:
    text = (ROOT / "plans" / "mlp.yaml").read_text()
    tree = load.load_text(text, "mlp.yaml")
    plan = compile_tree(tree, "mlp.yaml")
    src = tree._src
    assert src._tree is None  # compiling a good plan parsed nothing twice
    step = plan.epoch.tasks[0].do[0]
    assert isinstance(step.pos, LazyPos)
    assert step.pos.line > 0 and src._tree is not None
    assert step.pos == Pos("mlp.yaml", step.pos.line, step.pos.col)


def test_a_block_that_leaves_a_big_tree_freezes_it_for_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setattr(load, "FREEZE_AT", 1000)
    before = gc.get_freeze_count()
    try:
        with load.no_gc():
            small = [[] for _ in range(10)]
        assert gc.isenabled() and gc.get_freeze_count() == before
        with load.no_gc():
            big = [[] for _ in range(5000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + 5000
        assert len(small) + len(big) == 5010
    finally:
        gc.unfreeze()


def test_a_plan_keeps_its_positions_and_frees_its_tree_without_the_collector() -> None:
    import gc
    import weakref

    text = (ROOT / "plans" / "mlp.yaml").read_text()
    gc.disable()
    try:
        tree = load.load_text(text, "mlp.yaml")
        root = weakref.ref(tree)
        plan = compile_tree(tree, "mlp.yaml")
        step = plan.epoch.tasks[0].do[0]
        del tree
        # The plan holds its tree: positions still resolve once the caller's copy is gone.
        assert step.pos.line > 0 and root() is not None
        del plan, step
        assert root() is None  # freed by reference counting alone: no cycles
    finally:
        gc.enable()
