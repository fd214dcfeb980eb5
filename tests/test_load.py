"""The loader and `${var}` substitution: values, types and source positions (overrides:
test_overrides.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from jobrun.errors import PlanError, Pos
from jobrun.plans.compile import compile_text, compile_tree
from jobrun.plans.load import (
    MAX_DEPTH,
    PList,
    PMap,
    clone,
    load_file,
    load_text,
    parse_value,
    to_plain,
)
from jobrun.plans.overrides import apply_sets
from jobrun.plans.resolve import substitute

F = "p.yaml"

PLAN = """\
job: demo
max_epochs: 3
vars:
  lr: 0.1
  steps: 4
epoch:
  - task: train
    do:
      - loop: 10
        as: i
        do:
          - add: {in: [a, 1], out: a}
      - mul: {in: [a, "${lr}"], out: b}
    outputs: [a]
"""


def P(line: int, col: int, file: str = F) -> Pos:
    return Pos(file, line, col)


def error_of(fn, *args, **kwargs) -> PlanError:
    with pytest.raises(PlanError) as info:
        fn(*args, **kwargs)
    return info.value


# -- positions ---------------------------------------------------------------------------


def test_positions_of_keys_values_and_items() -> None:
    t = load_text(PLAN, F)
    assert t.pos == P(1, 1)
    assert t.key_at("max_epochs") == P(2, 1)
    assert t.at("max_epochs") == P(2, 13)
    assert t["vars"].at("lr") == P(4, 7)
    assert t["vars"].key_at("steps") == P(5, 3)
    epoch = t["epoch"]
    assert isinstance(epoch, PList) and epoch.at(0) == P(7, 5)
    task = epoch[0]
    assert task.key_at("do") == P(8, 5)
    loop = task["do"][0]
    assert loop.key_at("loop") == P(9, 9) and loop.at("as") == P(10, 13)
    add = loop["do"][0]["add"]
    assert add.key_at("in") == P(12, 19)
    assert add["in"].pos == P(12, 23)
    assert add["in"].at(0) == P(12, 24) and add["in"].at(1) == P(12, 27)
    assert add.at("out") == P(12, 36)
    assert task["outputs"].at(0) == P(14, 15)


def test_position_dicts_match_at() -> None:
    t = load_text(PLAN, F)
    add = t["epoch"][0]["do"][0]["do"][0]["add"]
    assert add.key_pos == {"in": P(12, 19), "out": P(12, 31)}
    assert add.val_pos == {"in": add.at("in"), "out": add.at("out")}
    assert add["in"].item_pos == [P(12, 24), P(12, 27)]


def test_missing_key_and_index_fall_back_to_the_container() -> None:
    t = load_text(PLAN, F)
    assert t.at("nope") == t.pos and t.key_at("nope") == t.pos
    items = t["epoch"][0]["outputs"]
    assert items.at(5) == items.pos and items.at(-1) == items.pos


def test_columns_count_characters_not_bytes() -> None:
    t = load_text("title: 'héhé'\nname: x\nlater: [é, ü, z]\n", F)
    assert t["later"].at(2) == P(3, 15)


def test_hand_built_containers() -> None:
    m = PMap(P(1, 1))
    m["a"] = 1
    m.key_pos["a"] = P(2, 1)
    m.val_pos["a"] = P(2, 4)
    assert m.at("a") == P(2, 4) and m.key_at("a") == P(2, 1) and m.at("b") == P(1, 1)
    lst = PList(P(3, 1))
    lst.append("x")
    lst.item_pos.append(P(3, 3))
    assert lst.at(0) == P(3, 3) and lst.at(1) == P(3, 1)


def test_load_file_positions_use_the_path(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("job: x\nseed: 3\n")
    t = load_file(path)
    assert t.at("seed") == Pos(str(path), 2, 7)


# -- values ------------------------------------------------------------------------------


def test_scalar_types() -> None:
    t = load_text(
        "i: 3\nf: 0.05\nb: true\nn: null\ne:\ns: abc\nq: '3'\nx: !!str 5\nbang: ! 7\n"
        "hex: 0x10\nneg: -2\nexp: 1.5e+3\non: yes\nlit: |\n  two\n  lines\n",
        F,
    )
    assert t == {
        "i": 3, "f": 0.05, "b": True, "n": None, "e": None, "s": "abc", "q": "3", "x": "5",
        "bang": "7", "hex": 16, "neg": -2, "exp": 1500.0, "on": True, "lit": "two\nlines\n",
    }
    assert type(t["i"]) is int and type(t["b"]) is bool


def test_keys_are_taken_as_written() -> None:
    t = load_text("on: 1\n1: 2\nnull: 3\n2020-01-01: 4\n.nan: 5\n'<<': 6\n", F)
    assert list(t) == ["on", "1", "null", "2020-01-01", ".nan", "<<"]


def test_merge_and_value_indicators_as_values_are_strings() -> None:
    assert load_text("a: <<\nb: =\n", F) == {"a": "<<", "b": "="}


def test_aliases_are_copied_not_shared() -> None:
    t = load_text("a: &x {k: [1, 2]}\nb: *x\n", F)
    assert t["a"] == t["b"] and t["a"] is not t["b"] and t["a"]["k"] is not t["b"]["k"]
    t["b"]["k"].append(3)
    assert t["a"]["k"] == [1, 2]
    assert t["b"].at("k") == t["a"].at("k")  # a copy points at what it copies


def test_byte_order_mark_is_ignored() -> None:
    assert load_text("\ufeffjob: x\n", F) == {"job": "x"}


def typed(value: object) -> object:
    """`value` with the type of every scalar beside it: True == 1 and 1.0 == 1 otherwise."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # YAML 1.1 words: booleans and null, but not y/n
        ("a: [yes, No, on, OFF, true, False, null, Null, ~, y, n]",
         {"a": [True, False, True, False, True, False, None, None, None, "y", "n"]}),
        # numbers as YAML 1.2 and Python write them (YAML 1.1 read 1e5 as a string, 1:30 as 90)
        ("a: {b: 1e5, c: 1.5e+5, d: 1.0e5, e: 0x1f, f: 0o7, g: 0b101, h: 1_000, i: 1:30, j: .5, k: -0, l: +1}",
         {"a": {"b": 1e5, "c": 150000.0, "d": 1e5, "e": 31, "f": 7, "g": 5, "h": 1000,
                "i": "1:30", "j": 0.5, "k": 0, "l": 1}}),
        ("a: [1e30, 1e-4, 1E5, +1.5e3, -2.5E-3, 1_000.5, 0., 1e-400]",
         {"a": [1e30, 1e-4, 1e5, 1500.0, -0.0025, 1000.5, 0.0, 0.0]}),
        ("a: [.inf, -.inf, +.inf, .Inf, -.INF, !!float .inf, !!float 3, !!int 0o10]",
         {"a": [math.inf, -math.inf, math.inf, math.inf, -math.inf, math.inf, 3.0, 8]}),
        # what only looks like a number stays a string
        ("a: [1e, e5, ., 1__0, 1_, 1.2.3, 0x, inf, nan, 12:30:00, 1_e5, 0xg]",
         {"a": ["1e", "e5", ".", "1__0", "1_", "1.2.3", "0x", "inf", "nan", "12:30:00", "1_e5", "0xg"]}),
        ("a: [1., -1.5, 9223372036854775807, -9223372036854775807]",
         {"a": [1.0, -1.5, 2**63 - 1, -(2**63 - 1)]}),
        # words next to those rules stay strings
        ("a: [b0_a/x.y-z, $x, a$b, _, __init__, yes_no, truex, nullable, -x]",
         {"a": ["b0_a/x.y-z", "$x", "a$b", "_", "__init__", "yes_no", "truex", "nullable", "-x"]}),
        ("a: [a b, c  d, 500ms, 2s, 3d, é, αβ, 'x y', \"z w\", '1', \"true\"]",
         {"a": ["a b", "c  d", "500ms", "2s", "3d", "é", "αβ", "x y", "z w", "1", "true"]}),
        ("a: ${x}\nb: \"${y}\"\nc: [\"${z}\", w]\n", {"a": "${x}", "b": "${y}", "c": ["${z}", "w"]}),
        # a colon inside a word, quoted keys, escapes
        ("a: x:y\nb: {c: d:e}\nf: {g:h}\n", {"a": "x:y", "b": {"c": "d:e"}, "f": {"g:h": None}}),
        ("'a': 1\n\"b\": 2\nc d: 3\n", {"a": 1, "b": 2, "c d": 3}),
        ("a: {\"b\":[1], \"c\" :2, 'd': 'it''s', e: \"x\\ty\"}",
         {"a": {"b": [1], "c": 2, "d": "it's", "e": "x\ty"}}),
        # flow collections: empty values, trailing commas, one-pair mappings, nesting, lines
        ("a: {b: , c: d}\ne: [b, ]\nf: {b}\ng: [b: c]\nh: [\"b\":1]\n",
         {"a": {"b": None, "c": "d"}, "e": ["b"], "f": {"b": None}, "g": [{"b": "c"}], "h": [{"b": 1}]}),
        ("a: [[1, [2, [3]]], {}, []]", {"a": [[1, [2, [3]]], {}, []]}),
        ("a: [b\n  , c]\n", {"a": ["b", "c"]}),
        # comments, in and after flows
        ("a: [b, c] # c\nd: [e]#f\ng: {in: [x, 1], out: y}  # h\n",
         {"a": ["b", "c"], "d": ["e"], "g": {"in": ["x", 1], "out": "y"}}),
        ("a: b #c\nd: b#c\ne: 'b' #c\n", {"a": "b", "d": "b#c", "e": "b"}),
        # block structure
        ("a:\n- b\n- c\nd: e", {"a": ["b", "c"], "d": "e"}),
        ("a:\n  - b: 1\n    c: 2\n  - d\n  - - e\n  -\n", {"a": [{"b": 1, "c": 2}, "d", ["e"], None]}),
        ("a:\n  b:\n  c:\n", {"a": {"b": None, "c": None}}),
        ("a: b\n   c\n", {"a": "b c"}),
        ("a: |\n  text\nb: >\n  more\n  text\n", {"a": "text\n", "b": "more text\n"}),
        ("? a\n: b\n", {"a": "b"}),
        ("a: [&x b, *x, !!str 1]", {"a": ["b", "b", "1"]}),
        # documents, line ends, tabs, byte order mark
        ("---\na: 1\n", {"a": 1}),
        ("a: 1\n...\n", {"a": 1}),
        ("%YAML 1.1\n---\na: 1\n", {"a": 1}),
        ("a: 1\r\nb: 2\r\n", {"a": 1, "b": 2}),
        ("a:\tb\n", {"a": "b"}),
        ("\ufeffa: 1\n", {"a": 1}),
    ],
)
def test_yaml_corner_cases(text: str, value: dict) -> None:
    assert typed(load_text(text, F)) == typed(value)


@pytest.mark.parametrize(
    ("text", "where", "pos"),
    [
        ("a: 1\r\nb: [x, y]\r\n", lambda t: t["b"].at(1), P(2, 8)),
        ("\ufeffa: 1\nb: 2\n", lambda t: t.key_at("b"), P(2, 1)),
        ("\ufeffa: 1\nb: 2\n", lambda t: t.at("a"), P(1, 4)),
        ("a:\tb\nc: d\n", lambda t: t.at("a"), P(1, 4)),
        ("a: [b\n  , c]  # x\nd: {e: f}  # y\n", lambda t: t["a"].at(1), P(2, 5)),
        ("a: [b\n  , c]  # x\nd: {e: f}  # y\n", lambda t: t["d"].at("e"), P(3, 8)),
        ("a: |\n  text\nb: >\n  more\nc: 1\n", lambda t: t.at("c"), P(5, 4)),
        ("a: b\n   c\nd: 2\n", lambda t: t.key_at("d"), P(3, 1)),
        ("  a: 1\n  b: [2]\n", lambda t: t["b"].at(0), P(2, 7)),
        ("%YAML 1.1\n---\na: 1\n", lambda t: t.pos, P(3, 1)),
        ("? a\n: b\n", lambda t: t.at("a"), P(2, 3)),
        ("a:\n- b\n- c\n", lambda t: t["a"].at(1), P(3, 3)),
    ],
)
def test_corner_case_positions(text: str, where, pos: Pos) -> None:
    assert where(load_text(text, F)) == pos


@pytest.mark.parametrize(
    ("text", "pos", "words"),
    [
        ("", P(1, 1), "empty"),
        ("# only a comment\n", P(1, 1), "empty"),
        ("---\n", P(1, 1), "empty"),
        ("- a\n", P(1, 1), "not a list"),
        ("a: 1\na: 2\n", P(2, 1), "duplicate key 'a'"),
        ("a: {b: 1, b: 2}\n", P(1, 11), "duplicate key 'b'"),
        ("a: !!python/name:os.system\n", P(1, 4), "!!python/name:os.system"),
        ("a: !!float abc\n", P(1, 4), "not a number"),
        ("a: !!bool maybe\n", P(1, 4), "not a boolean"),
        ("a: !!int 1" + "0" * 5000 + "\n", P(1, 4), "too large"),
        ("a: " + "9" * 5000 + "\n", P(1, 4), "too large"),
        ("a: 9223372036854775808\n", P(1, 4), "too large"),
        ("a: 017\n", P(1, 4), "017 is ambiguous"),
        ("a: [1, -08]\n", P(1, 8), "-08 is ambiguous"),
        ("a: 1e400\n", P(1, 4), "too large for a number"),
        ("a: !!float .NaN\n", P(1, 4), "not a number"),
        ("a: !!timestamp 2020-01-01\n", P(1, 4), "dates"),
        ("a: &x [1, *x]\n", P(1, 11), "recursive"),
        ("? [a]\n: 1\n", P(1, 3), "plain word"),
        ("a: &k 1\n*k : 2\n", P(2, 1), "plain word, not an alias"),
        ("a: 1\n---\nb: 2\n", P(2, 1), "one YAML document"),
        ("a: b\x00\n", P(1, 5), "NUL"),
        ("a: \ud800\n", P(1, 4), "U+D800"),
        ("a: " + "[" * 150 + "]" * 150 + "\n", P(1, 3 + MAX_DEPTH), f"more than {MAX_DEPTH}"),
        ("a: 'open\n", P(1, 4), "never closed"),
        ("a: [1., 12345678901234567890]\n", P(1, 9), "too large"),
        ("a: .nan\n", P(1, 4), ".nan (not a number) cannot be a plan value"),
        ("a: [1, -.NAN]\n", P(1, 8), "not a number"),
        ("a: yes\nb: 2020-01-01\n", P(2, 4), "reads as a date"),
        ("a: {b: c, b: d}", P(1, 11), "duplicate key 'b' (first at line 1, column 5)"),
        ("a: {<<: {b: c}}", P(1, 5), "merge keys"),
        ("<<: {a: 1}\n", P(1, 1), "merge keys"),
        ("a: !b c\n", P(1, 4), "tag !b is not allowed"),
        ("a", P(1, 1), "not the string 'a'"),
        ("[a, b]", P(1, 1), "not a list"),
        # YAML syntax errors: libyaml's message, placed where it stops
        ("a: {b: c #d}", P(2, 1), "to close the '{' at line 1, column 4"),
        ("a: {b: ${x}}\n", P(1, 9), "to close the '{' at line 1, column 4"),
        ("a: {b: c, d:[e]}", P(1, 12), "found unexpected ':'"),
        ("a: {b:{c: 1}}", P(1, 6), "found unexpected ':'"),
        ("a: [b, c], [d]", P(1, 10), "did not find expected key"),
        ("a: 1\n  b: 2\n", P(2, 4), "unexpected ':'"),
        ("a: b: c\n", P(1, 5), "unexpected ':'"),
        ("a:\n  b: 1\n c: 2\n", P(3, 2), "while parsing a block mapping at line 1, column 1"),
        ("a: - b\n", P(1, 4), "block sequence entries are not allowed"),
        ("a: \"b\" c\n", P(1, 8), "did not find expected key"),
        ("a: @b\n", P(1, 4), "cannot start any token"),
        ("a: `b`\n", P(1, 4), "cannot start any token"),
        ("a:\n\tb: 1\n", P(2, 1), "tab"),
    ],
)
def test_refused(text: str, pos: Pos, words: str) -> None:
    e = error_of(load_text, text, F)
    assert e.pos == pos, e.format_message()
    assert words in e.message


@pytest.mark.parametrize("depth", [101, 200_000])
def test_very_deep_nesting_is_refused_without_crashing(depth: int) -> None:
    # libyaml's own composer recursed per level and crashed the interpreter at 200,000;
    # newer libyaml stops at 1,000 with a message of its own: the user sees ours either way.
    e = error_of(load_text, "x: " + "[" * depth + "]" * depth + "\n", F)
    assert e.message == "plan is nested more than 100 levels deep"
    assert "flatten the plan" in e.hint


def test_alias_bomb_fails_fast() -> None:
    text = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    prev = "a"
    for name in "bcdefghi":
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
        prev = name
    e = error_of(load_text, text, F)  # the expansion budget stops it: no hang, no memory blow-up
    assert "aliases expand" in e.message and e.pos.line > 1


def test_non_utf8_file_points_at_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"job: x\nname: ab\xffc\n")
    e = error_of(load_file, path)
    assert e.pos == Pos(str(path), 2, 9) and "UTF-8" in e.message


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert "no such plan file" in error_of(load_file, tmp_path / "nope.yaml").message
    assert "directory" in error_of(load_file, tmp_path).message


def test_parse_value_takes_any_value() -> None:
    assert parse_value("", "v") is None
    assert parse_value("[1, a]", "v") == [1, "a"]
    assert parse_value("{a: 1}", "v") == {"a": 1}


def test_to_plain_drops_positions() -> None:
    t = load_text(PLAN, F)
    plain = to_plain(t)
    assert type(plain) is dict and plain == t
    assert type(plain["epoch"]) is list and type(plain["epoch"][0]["do"][0]) is dict
    assert plain["epoch"][0]["do"][0]["do"][0] == {"add": {"in": ["a", 1], "out": "a"}}


def test_clone_is_deep() -> None:
    t = load_text(PLAN, F)
    c = clone(t)
    assert c == t and c["epoch"] is not t["epoch"]
    assert c["epoch"][0]["do"][0].key_at("loop") == P(9, 9)


# -- ${var} substitution -----------------------------------------------------------------


def subst(text: str, **builtins: str) -> PMap:
    t = load_text(text, F)
    return substitute(t, {"plan_dir": "/plans", "run_dir": "/runs/x", **builtins})


def test_whole_reference_keeps_the_type() -> None:
    t = subst("vars: {n: 3, f: 0.5, b: false, z: null, l: [1, 2], m: {k: v}}\n"
              "a: ${n}\nb: '${f}'\nc: \"${b}\"\nd: ${z}\ne: ${l}\ng: ${m}\nh: ${ n }\n")
    assert t["a"] == 3 and type(t["a"]) is int
    assert t["b"] == 0.5 and t["c"] is False and t["d"] is None and t["h"] == 3
    assert t["e"] == [1, 2] and t["g"] == {"k": "v"}
    assert t["e"] is not t["vars"]["l"]  # a copy: editing one does not change the other


def test_embedded_reference_is_text() -> None:
    t = subst("vars: {n: 3, f: 0.5, b: true, z: null, l: [1, a]}\n"
              "a: run-${n}\nb: lr=${f}/${b}\nc: ${z}!\nd: 'l=${l}'\n")
    assert t["a"] == "run-3" and t["b"] == "lr=0.5/true" and t["c"] == "null!"
    assert t["d"] == 'l=[1, "a"]'


def test_dollar_escape() -> None:
    t = subst("vars: {x: 1}\na: $${x}\nb: cost $${x} and ${x}\nc: $5\n")
    assert t["a"] == "${x}" and t["b"] == "cost ${x} and 1" and t["c"] == "$5"


def test_builtins() -> None:
    t = subst("a: ${plan_dir}/data.npz\nb: ${run_dir}\nvars: {out: '${run_dir}/model'}\nc: ${out}\n")
    assert t["a"] == "/plans/data.npz" and t["b"] == "/runs/x" and t["c"] == "/runs/x/model"


def test_builtins_from_compile() -> None:
    plan = compile_text(
        "job: j\nmax_epochs: 1\nepoch:\n  - task: t\n    do:\n"
        "      - save: {in: [a], path: '${run_dir}/a.json'}\n      - load: {out: [b], path: '${plan_dir}/b.json'}\n",
        "plans/p.yaml",
    )
    do = plan.epoch.tasks[0].do
    assert do[0].kwargs["path"] == str(Path("runs/j/a.json"))
    assert do[1].kwargs["path"] == "plans/b.json"


def test_vars_use_earlier_vars() -> None:
    t = subst("vars:\n  base: 10\n  twice: ${base}\n  name: n${twice}\n  all: ['${base}', '${name}']\nx: ${all}\n")
    assert t["vars"] == {"base": 10, "twice": 10, "name": "n10", "all": [10, "n10"]}
    assert t["x"] == [10, "n10"]


def test_keys_are_not_substituted() -> None:
    assert "${x}" in subst("vars: {x: 1}\nm: {'${x}': 2}\n")["m"]


@pytest.mark.parametrize(
    ("text", "pos", "message", "hint"),
    [
        ("vars: {rate: 1}\na: ${rte}\n", P(2, 4), "undefined variable ${rte}", "did you mean 'rate'?"),
        ("vars: {a: '${b}', b: 1}\n", P(1, 11), "undefined variable ${b}", "defined below"),
        ("vars: {a: 'x${a}'}\n", P(1, 11), "undefined variable ${a}", "cannot use itself"),
        ("a: [1, '${nope}']\n", P(1, 8), "undefined variable ${nope}", "define it under `vars:`"),
        ("vars: [a]\n", P(1, 7), "`vars` must be a mapping", "vars: {lr: 0.1}"),
        ("vars: {run_dir: x}\n", P(1, 8), "built in", "rename"),
        ("vars: {'a-b': 1}\n", P(1, 8), "bad var name", "letters"),
    ],
)
def test_bad_references(text: str, pos: Pos, message: str, hint: str) -> None:
    e = error_of(subst, text)
    assert e.pos == pos, e.format_message()
    assert message in e.message and hint in (e.hint or "")


def test_errors_in_values_from_vars_and_sets_point_where_they_were_written() -> None:
    plan = (
        "job: j\nvars:\n  outs: [ok, 9bad]\nepoch:\n  - task: t\n    do:\n"
        "      - add: {in: [a, 1], out: \"${outs}\"}\n"
    )
    e = error_of(compile_text, plan, F)
    assert e.pos == P(3, 14) and "'9bad'" in e.message
    e = error_of(compile_text, plan.replace("9bad", "ok2"), F, ["epoch.0.do.0.add.out=7"])
    assert e.pos == Pos("--set epoch.0.do.0.add.out=7") and "not the number 7" in e.message


def test_var_bombs_are_stopped() -> None:
    text = "vars:\n  a: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n"
    prev = "a"
    for name in "bcdefgh":
        text += f"  {name}: [" + ", ".join([f"'${{{prev}}}'"] * 10) + "]\n"
        prev = name
    e = error_of(subst, text)
    assert "vars expand" in e.message


def test_compile_tree_leaves_the_resolved_plan_in_the_tree() -> None:
    t = load_text(PLAN, F)
    compile_tree(t, F, ["vars.lr=0.2"])
    assert t["epoch"][0]["do"][1]["mul"]["in"] == ["a", 0.2]
    assert to_plain(t)["vars"] == {"lr": 0.2, "steps": 4}


def test_sets_and_vars_cannot_nest_deeper_than_the_loader_allows() -> None:
    # Everything after the loader walks the tree recursively; its depth bound must hold.
    e = error_of(apply_sets, load_text(PLAN, F), ["+vars." + ".".join(["a"] * MAX_DEPTH) + "=1"])
    assert "levels deep" in e.message
    head = "job: j\nmax_epochs: 1\nepoch: [{task: t, do: [{const: {out: a, value: "
    n = MAX_DEPTH - 6  # the value's first list is the 7th container from the top
    load_text(head + "[" * n + "]" * n + "}}]}]\n", F)
    for depth, ok in ((n, True), (n + 1, False)):
        text = "vars: {v: " + "[" * depth + "]" * depth + "}\n" + head + "'${v}'}}]}]\n"
        if ok:
            compile_text(text, F)
        else:
            assert "levels deep" in error_of(compile_text, text, F).message
    chain = "vars:\n  v0: [1]\n" + "".join(f"  v{i}: ['${{v{i - 1}}}']\n" for i in range(1, 150))
    assert "levels deep" in error_of(subst, chain).message


@pytest.mark.parametrize(
    "text",
    [
        "job: j\nmax_epochs: 1\nepoch: [{task: t, do: [{copy: {in: a, out: '" + "x-" * 5000 + "'}}]}]\n",
        "job: '" + "j" * 10_000 + "'\n",
        "job: j\nmax_epochs: 1\nepoch: [{task: t, do: ['" + "w" * 10_000 + "']}]\n",
        "job: j\nvars: {a: 1}\nx: '${" + "v" * 10_000 + "}'\n",
        "job: j\nmax_epochs: 1\nepoch: [{task: t, do: [{loop: '" + "9" * 10_000 + "', do: []}]}]\n",
    ],
    ids=["blob", "job", "bare-word", "var", "loop-count"],
)
def test_messages_stay_short_for_huge_values(text: str) -> None:
    e = error_of(compile_text, text, F)
    assert len(e.format_message()) < 400, e.format_message()[:500]


def test_set_reaches_arguments_of_dotted_op_names():
    from jobrun.plans.compile import compile_text

    text = """
job: j
max_epochs: 1
epoch:
  - task: t
    do:
      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}
"""
    plan = compile_text(text, "p.yaml", sets=["epoch.0.do.0.data.synthetic.n=64"])
    assert plan.epoch.tasks[0].do[0].kwargs["n"] == 64


def test_a_string_holding_a_nul_is_refused_at_its_place() -> None:
    # A quoted "\0" (in a plan, or a --set value) made a job name or a path that the OS
    # refuses: `train` gave a traceback.
    from jobrun.errors import PlanError
    from jobrun.plans.load import parse_value

    with pytest.raises(PlanError) as e:
        load_text('job: x\nvars: {name: "a\\0b"}\n', "p.yaml")
    assert "NUL character" in e.value.message and e.value.pos == Pos("p.yaml", 2, 14)
    with pytest.raises(PlanError, match="NUL character"):
        parse_value('"a\\0b"', "--set")
    assert load_text('job: "a\\tb"\n')["job"] == "a\tb"  # other escapes are fine
