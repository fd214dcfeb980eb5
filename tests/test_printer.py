"""`jobrun print`: golden files, every construct, JSON shape, determinism, no torch.

Golden files live in tests/golden/print/. After an intended change of the output, or for a
new plan in plans/, regenerate them and review the diff before committing:

    JOBRUN_UPDATE_GOLDEN=1 python -m pytest tests/test_printer.py
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from runner_util import HANG_S

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.colour import print_rich
from jobrun.plans.compile import compile_file, compile_text
from jobrun.plans.printer import (
    MAX_LITERAL,
    factor_names,
    format_arg,
    format_value,
    render_json,
    render_text,
)

ROOT = Path(__file__).resolve().parent.parent
PLANS = sorted((ROOT / "plans").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden" / "print"
UPDATE = os.environ.get("JOBRUN_UPDATE_GOLDEN") == "1"
UPDATE_HOW = "JOBRUN_UPDATE_GOLDEN=1 python -m pytest tests/test_printer.py"

LONG_MSG = "this message is long enough to be cut by the printer, because it goes on and on"

EVERY_CONSTRUCT = f"""
job: every-construct
seed: 7
device: cpu
replicas: 2
vars: {{steps: 3, tag: run}}
max_epochs: 2
stop_when: [done, enc/stop]
early_stop: {{monitor: done, mode: max, patience: 2, min_delta: 0.5}}
checkpoint: {{dir: ckpt, every: 2, keep: null, upload: uploads, best: {{monitor: enc/stop, mode: max}}}}

init:
  - task: setup
    node: trainer-0
    do:
      - const: {{out: enc/w, value: [1.0, 2.0]}}
      - const: {{out: enc/b, value: 0.5}}
      - const: {{out: enc/l1/w, value: 1}}
      - const: {{out: enc/l1/b, value: 2}}
      - fill: {{out: big, shape: [64, 64], value: 0.0, dtype: float32}}
      - copy:

epoch:
  - task: train
    node: trainer-0
    instances: 2
    init:
      - const: {{out: n, value: 2}}
    do:
      - loop: "${{steps}}"
        as: i
        id: outer
        do:
          - mul: {{in: [enc/w, enc/b, enc/l1/w, enc/l1/b, i, 10, 2.5, true, dec/w, dec/b], out: prod}}
      - loop: n
        do:
          - log: {{in: [prod]}}
      - loop: null
        as: k
        do:
          - ge: {{in: [prod, 100], out: enc/stop}}
            id: check
          - stop_if: enc/stop
      - if: enc/stop
        then:
          - log: {{in: [prod], msg: "stopped"}}
        elif:
          - if: c2
            then:
              - copy: {{in: prod, out: c3}}
          - if: c3
            then: []
        else:
          - const: {{out: c2, value: false}}
      - parallel:
          - name: left
            do:
              - copy: {{in: enc/w, out: left/w}}
          - do:
              - copy: {{in: enc/b, out: right/b}}
      - report: 500ms
        do:
          - log: {{in: [prod], msg: tick}}
      - log: {{in: [prod], msg: "{LONG_MSG}"}}
      - log: {{in: [prod], msg: "quote \\" back\\\\slash
          new\\nline tab\\t", 'odd key': 1, nested: {{a: 1, "b c": [true, null]}}}}
      - call:
          fn: "tests.helpers:f"
          in: [enc/w, enc/b, 3]
          out: [dec/w, dec/b, other]
          values: [{", ".join(str(i) for i in range(40))}]
          short: [1, 2]
          empty: {{}}
      - const: {{out: done, value: true}}
    exit:
      - log: {{in: [n], msg: bye}}
    outputs: [done, enc/stop, enc/w, enc/b]

  - task: watch
    node: monitor
    workspace: global
    do: []

download:
  - task: gather
    node: trainer-0
    do:
      - copy: {{in: enc/w, out: final/w}}
    exit:
      - log: {{in: [final/w]}}

exit:
  - task: save
    node: trainer-0
    do:
      - save: {{in: [enc/w, enc/b, enc/l1/w], path: model.json}}
"""


def every_construct() -> ir.Plan:
    return compile_text(EVERY_CONSTRUCT, "every_construct.yaml")


def compile_plan(path: Path, monkeypatch: pytest.MonkeyPatch) -> ir.Plan:
    # A relative path keeps ${plan_dir} (and so the golden) the same on every machine.
    monkeypatch.chdir(ROOT)
    return compile_file(path.relative_to(ROOT))


def check_golden(golden: Path, actual: str) -> None:
    rel = golden.relative_to(ROOT) if golden.is_relative_to(ROOT) else golden
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(actual, encoding="utf-8")
        return
    if not golden.exists():
        pytest.fail(f"no golden file {rel}; create it with: {UPDATE_HOW}", pytrace=False)
    expected = golden.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                actual.splitlines(keepends=True),
                fromfile=f"{rel} (golden)",
                tofile="rendered now",
            )
        )
        pytest.fail(
            f"the printed plan differs from {rel}:\n{diff}\nif the change is intended: {UPDATE_HOW}",
            pytrace=False,
        )


# -- golden files ----------------------------------------------------------------------


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_plan_matches_golden(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = render_text(compile_plan(path, monkeypatch))
    check_golden(GOLDEN / "plans" / f"{path.stem}.txt", text)


def test_no_golden_without_its_plan() -> None:
    stale = sorted(
        g.name for g in (GOLDEN / "plans").glob("*.txt") if not (ROOT / "plans" / f"{g.stem}.yaml").exists()
    )
    assert not stale, f"golden files in {GOLDEN / 'plans'} whose plan is gone: {stale}; delete them"


def test_every_construct_matches_golden() -> None:
    check_golden(GOLDEN / "every_construct.txt", render_text(every_construct()))


def test_every_construct_factored_matches_golden() -> None:
    text = render_text(every_construct(), factor_prefixes=True)
    check_golden(GOLDEN / "every_construct.factored.txt", text)


@pytest.mark.skipif(UPDATE, reason="checks the golden check itself, which updates now")
def test_golden_check_fails_readably_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    with pytest.raises(pytest.fail.Exception, match="JOBRUN_UPDATE_GOLDEN=1"):
        check_golden(missing, "text\n")
    assert not missing.exists()
    golden = tmp_path / "golden.txt"
    golden.write_text("a\nb\n")
    with pytest.raises(pytest.fail.Exception) as failure:
        check_golden(golden, "a\nc\n")
    assert "-b\n+c" in str(failure.value) and "JOBRUN_UPDATE_GOLDEN=1" in str(failure.value)
    check_golden(golden, "a\nb\n")


# -- the text, construct by construct --------------------------------------------------


@pytest.fixture(scope="module")
def text() -> str:
    return render_text(every_construct())


@pytest.fixture(scope="module")
def lines(text: str) -> list[str]:
    return text.splitlines()


def test_header(lines: list[str]) -> None:
    assert lines[:9] == [
        "job: every-construct",
        "seed: 7",
        "device: cpu",
        "replicas: 2",
        'vars: {steps: 3, tag: "run"}',
        "max_epochs: 2",
        "stop_when: [done, enc/stop]",
        'early_stop: {monitor: "done", mode: "max", patience: 2, min_delta: 0.5}',
        'checkpoint: {dir: "ckpt", every: 2, keep: null, upload: "uploads", best: {monitor: "enc/stop", '
        'mode: "max", keep: 1}}',
    ]
    # what each node's checkpoints hold: the blobs epoch steps write, per node
    assert lines[9:11] == [
        "checkpointed @ trainer-0: [] + random state",
        "checkpointed @ monitor: [] + random state",
    ]


def test_groups_in_order(lines: list[str]) -> None:
    groups = [line for line in lines if line and not line.startswith(" ") and ":" in line][11:]
    assert groups == [
        "init:",
        "epoch (repeat until done or enc/stop or no done better by more than 0.5 for 2 epochs or epoch 2):",
        "download:",
        "exit:",
    ]


def test_empty_groups_are_left_out() -> None:
    plan = compile_text("job: j\nmax_epochs: 1\nepoch: [{task: t, do: []}]\n")
    assert render_text(plan) == (
        "job: j\nseed: 0\ndevice: auto\nreplicas: 1\nmax_epochs: 1\nstop_when: []\n"
        "checkpoint: off\n\nepoch (repeat until epoch 1):\n    task t @ local [private]:\n        pass\n"
    )


def test_max_restarts_is_shown_when_set_and_checked() -> None:
    from jobrun.errors import PlanError

    plan = compile_text("job: j\nmax_restarts: 2\nmax_epochs: 1\nepoch: [{task: t, do: []}]\n")
    assert plan.max_restarts == 2
    assert "max_restarts: 2" in render_text(plan).splitlines()
    assert "max_restarts" not in render_text(compile_text("job: j\nmax_epochs: 1\nepoch: [{task: t, do: []}]\n"))
    with pytest.raises(PlanError, match="max_restarts is -1; it must be from 0 to 1000"):
        compile_text("job: j\nmax_restarts: -1\nmax_epochs: 1\nepoch: [{task: t, do: []}]\n")


def test_no_stop_condition_is_shown() -> None:
    plan = compile_text("job: j\nepoch: [{task: t, do: []}]\n")
    assert "epoch (repeat forever: no stop condition):" in render_text(plan)


def test_task_lines(lines: list[str]) -> None:
    assert "    task setup @ trainer-0 [global]:" in lines
    assert (
        "    task train @ trainer-0 [private, instances=2] -> outputs [done, enc/stop, enc/w, enc/b]:"
        in lines
    )
    assert "    task watch @ monitor [global]:" in lines


def test_task_sections_are_labelled_when_init_or_exit_exist(text: str) -> None:
    assert "    task gather @ trainer-0 [private]:\n        do:\n            final/w = copy(enc/w)\n" \
        "        exit:\n            log(final/w)\n" in text
    assert "        init:\n            n = const(value=2)\n        do:\n" in text
    # A task with only `do` has its steps right under it, and an empty one says so.
    assert "    task save @ trainer-0 [private]:\n        save(enc/w" in text
    assert "    task watch @ monitor [global]:\n        pass\n" in text


def test_op_lines(lines: list[str]) -> None:
    assert "        enc/w = const(value=[1.0, 2.0])" in lines
    assert '        big = fill(shape=[64, 64], value=0.0, dtype="float32")' in lines
    assert "        copy()" in lines  # `- copy:` with no arguments
    assert '        save(enc/w, enc/b, enc/l1/w, path="model.json")' in lines


def test_literal_inputs_are_shown_as_written(text: str) -> None:
    assert "prod = mul(enc/w, enc/b, enc/l1/w, enc/l1/b, i, 10, 2.5, true, dec/w, dec/b)" in text
    assert "enc/stop = ge(prod, 100)" in text


def test_loops(text: str) -> None:
    assert "            loop 3 as i:  # id: outer\n                prod = mul(" in text  # ${steps} substituted
    assert "            loop n:\n                log(prod)\n" in text
    assert "            loop until stop as k:\n" in text
    assert "                stop_if enc/stop\n" in text
    assert "                enc/stop = ge(prod, 100)  # id: check\n" in text


def test_early_stop_in_the_epoch_header() -> None:
    base = "job: j\nepoch: [{task: t, do: [{const: {out: val_loss, value: 1}}], outputs: [val_loss]}]\n"
    for extra, header in (
        ("early_stop: {monitor: val_loss}\n", "epoch (repeat until no better val_loss for 3 epochs):"),
        ("early_stop: {monitor: val_loss, patience: 1}\nmax_epochs: 10\n",
         "epoch (repeat until no better val_loss for 1 epoch or epoch 10):"),
        ("early_stop: {monitor: val_loss, patience: 0, min_delta: 1e-3}\n",
         "epoch (repeat until no val_loss better by more than 0.001 for 1 epoch):"),
    ):
        assert header in render_text(compile_text(extra + base)).splitlines()


def test_if_elif_else(text: str) -> None:
    assert (
        "            if enc/stop:\n"
        '                log(prod, msg="stopped")\n'
        "            elif c2:\n"
        "                c3 = copy(prod)\n"
        "            elif c3:\n"
        "                pass\n"
        "            else:\n"
        "                c2 = const(value=false)\n"
    ) in text


def test_parallel_and_report(text: str) -> None:
    assert (
        "            parallel:\n"
        "                branch left:\n"
        "                    left/w = copy(enc/w)\n"
        "                branch:\n"
        "                    right/b = copy(enc/b)\n"
        "            report every 500ms:\n"
        '                log(prod, msg="tick")\n'
    ) in text


def test_long_strings_and_lists_are_cut(text: str) -> None:
    quoted = json.dumps(LONG_MSG)
    assert f"log(prod, msg={quoted[:MAX_LITERAL]}...<+len={len(quoted)}>)" in text
    values = "[" + ", ".join(str(i) for i in range(40)) + "]"
    assert f"values={values[:MAX_LITERAL]}...<+len={len(values)}>, short=[1, 2], empty={{}})" in text


def test_strings_are_escaped_onto_one_line(text: str) -> None:
    line = next(ln for ln in text.splitlines() if "odd key" in ln)
    assert line.strip() == (
        r'log(prod, msg="quote \" back\\slash new\nline tab\t", "odd key"=1, '
        r'nested={a: 1, "b c": [true, null]})'
    )


def test_format_arg_shows_every_key_of_a_mapping_and_cuts_only_its_long_values() -> None:
    # An EMA built through `build`: its decay sat past the 64th character, cut away.
    ema = {"target": "torch.optim.swa_utils.get_ema_multi_avg_fn", "decay": 0.999}
    assert format_arg(ema) == '{target: "torch.optim.swa_utils.get_ema_multi_avg_fn", decay: 0.999}'
    layers = [{"target": "torch.nn.Linear", "args": [16, 64]}] * 3 + [{"target": "torch.nn.ReLU"}]
    assert format_arg(layers).endswith('{target: "torch.nn.Linear", args: [16, 64]}, {target: "torch.nn.ReLU"}]')
    nested = {"a": {"b": "x" * 70, "c": list(range(40))}, "decay": 0.9}
    text = format_arg(nested)
    assert text.startswith('{a: {b: "' + "x" * 63 + "...<+len=72>, c: [0, 1, 2")
    assert text.endswith(">}, decay: 0.9}")


def test_format_arg_cuts_at_the_limit() -> None:
    assert format_arg("x" * 62) == '"' + "x" * 62 + '"'  # 64 characters: kept whole
    assert format_arg("x" * 63) == '"' + "x" * 63 + "...<+len=65>"
    assert format_arg(list(range(100)))[MAX_LITERAL:] == f"...<+len={len(format_value(list(range(100))))}>"
    assert format_arg(10**18) == str(10**18)  # numbers are never cut
    assert format_value(["a", 1, None, {"k": 1e-05}]) == '["a", 1, null, {k: 1e-05}]'


def test_unusual_characters_never_break_a_line() -> None:
    for s in ("a\u2028b", "a\rb", "a\x85b", "\x1b[31mred"):
        assert len(format_value(s).splitlines()) == 1, repr(s)


# -- factor prefixes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "factored"),
    [
        (["enc/w", "enc/b"], ["enc/[w, b]"]),
        (["enc/w", "enc/b", "enc/l1/w", "enc/l1/b"], ["enc/[w, b, l1/[w, b]]"]),
        (["a/b/c", "a/b/d"], ["a/b/[c, d]"]),
        (["enc/w", "dec/w", "enc/b"], ["enc/w", "dec/w", "enc/b"]),  # order is kept
        (["x", "enc/w", "enc/b", "y"], ["x", "enc/[w, b]", "y"]),
        (["enc", "enc/w"], ["enc", "enc/w"]),
        (["enc/w"], ["enc/w"]),
        ([], []),
    ],
)
def test_factor_names(names: list[str], factored: list[str]) -> None:
    assert factor_names(names) == factored


def test_factor_prefixes_in_the_text() -> None:
    text = render_text(every_construct(), factor_prefixes=True)
    assert "stop_when: [done, enc/stop]" in text
    assert "-> outputs [done, enc/[stop, w, b]]:" in text
    # Literals keep their places and split the runs of names around them.
    assert "prod = mul(enc/[w, b, l1/[w, b]], i, 10, 2.5, true, dec/[w, b])" in text
    assert "dec/[w, b], other = call(enc/[w, b], 3, fn=" in text
    assert 'save(enc/[w, b, l1/w], path="model.json")' in text


# -- JSON ------------------------------------------------------------------------------


def test_json_shape() -> None:
    data = render_json(every_construct())
    json.dumps(data)  # JSON-able
    assert list(data) == [
        "job", "source", "seed", "device", "replicas", "parallel", "fsdp_layers", "fsdp_amp",
        "max_restarts", "vars", "max_epochs", "max_steps", "stop_when", "early_stop", "checkpoint", "loggers", "groups",
    ]
    assert data["max_restarts"] == 0 and data["parallel"] == "ddp" and data["fsdp_layers"] == []
    assert data["fsdp_amp"] is None
    assert data["early_stop"] == {"monitor": "done", "mode": "max", "patience": 2, "min_delta": 0.5}
    assert data["checkpoint"] == {
        "dir": "ckpt", "every": 2, "keep": None, "upload": "uploads", "async": False,
        "best": {"monitor": "enc/stop", "mode": "max", "keep": 1},
        "include": [], "exclude": [], "blobs": {"trainer-0": [], "monitor": []},
    }
    assert [g["name"] for g in data["groups"]] == ["init", "epoch", "download", "exit"]
    train = data["groups"][1]["tasks"][0]
    assert {k: train[k] for k in ("name", "node", "workspace", "instances", "outputs")} == {
        "name": "train", "node": "trainer-0", "workspace": "private", "instances": 2,
        "outputs": ["done", "enc/stop", "enc/w", "enc/b"],
    }
    kinds = [step["kind"] for step in train["do"]]
    assert kinds == ["loop", "loop", "loop", "if", "parallel", "report", "op", "op", "op", "op"]
    loop = train["do"][0]
    assert (loop["count"], loop["as"], loop["id"]) == (3, "i", "outer")
    assert train["do"][2]["do"][0]["id"] == "check" and train["do"][1]["id"] is None
    assert (train["do"][1]["count"], train["do"][2]["count"]) == ("n", None)
    mul = loop["do"][0]
    assert mul["op"] == "mul" and mul["out"] == ["prod"]
    assert mul["in"][4:8] == ["i", 10, 2.5, True]
    assert isinstance(mul["line"], int) and mul["line"] > 0
    assert train["do"][3]["else"][0]["args"] == {"value": False}
    assert [b["name"] for b in train["do"][4]["branches"]] == ["left", None]
    assert train["do"][5]["every"] == "500ms" and train["do"][5]["seconds"] == 0.5
    call = train["do"][8]
    assert call["args"]["values"] == list(range(40))  # never cut in JSON


def test_json_of_a_stopless_plan_has_every_group() -> None:
    data = render_json(compile_text("job: j\nepoch: [{task: t, do: []}]\n"))
    assert [(g["name"], g["tasks"] != []) for g in data["groups"]] == [
        ("init", False), ("epoch", True), ("download", False), ("exit", False),
    ]
    assert data["checkpoint"] is None and data["max_epochs"] is None


# -- determinism, CLI, imports, speed --------------------------------------------------


def test_deterministic() -> None:
    a, b = every_construct(), every_construct()
    assert render_text(a) == render_text(a) == render_text(b)
    assert render_text(a, True) == render_text(b, True)
    assert json.dumps(render_json(a)) == json.dumps(render_json(b))
    assert not re.search(r"0x[0-9a-f]{6,}", render_text(a))  # no object addresses


def _jobrun(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "jobrun", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("path", PLANS[:1], ids=[p.stem for p in PLANS[:1]])
def test_cli_print_equals_render_text(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rel = str(path.relative_to(ROOT))
    plan = compile_plan(path, monkeypatch)
    assert _jobrun("print", rel) == render_text(plan)
    assert _jobrun("print", rel, "--factor-prefixes") == render_text(plan, factor_prefixes=True)
    assert json.loads(_jobrun("print", rel, "--format", "json")) == render_json(plan)


def test_print_imports_neither_torch_nor_rich(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(EVERY_CONSTRUCT)
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['jobrun', 'print', {str(plan)!r}]\n"
        "try:\n"
        "    runpy.run_module('jobrun', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "from jobrun.plans.printer import render_json\n"
        "from jobrun.plans.compile import compile_file\n"
        f"render_json(compile_file({str(plan)!r}))\n"
        "heavy = sorted(m for m in ('torch', 'rich') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr


def test_print_rich_keeps_the_text(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    text = render_text(every_construct())
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    print_rich(text)
    assert capsys.readouterr().out == text


def test_print_rich_colours_without_rewrapping(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    text = render_text(every_construct())
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "40")  # narrower than many lines: they must not wrap
    print_rich(text)
    out = capsys.readouterr().out
    assert "\x1b[" in out
    assert re.sub(r"\x1b\[[0-9;]*m", "", out) == text


@pytest.fixture(scope="module")
def big_plan() -> ir.Plan:
    n_ops = 100_000
    p = Pos("big.yaml", 1, 1)
    ops = tuple(
        ir.OpCall(
            "add",
            (ir.BlobRef(f"enc{k}/w", p), ir.BlobRef(f"enc{k}/b", p), ir.Literal(1.5, p)),
            (ir.BlobRef(f"out{k}", p),),
            (("msg", f"step {k}"), ("shape", [k, 4])),
            p,
        )
        for k in range(n_ops)
    )
    task = ir.Task("t", "epoch", "local", "private", 1, (), (ir.Loop(2, None, ops, p),), (), (), p)
    groups = [ir.Group(name, (task,) if name == "epoch" else (), p) for name in ir.GROUPS]
    return ir.Plan("big", 0, "auto", 1, {}, 1, (), None, *groups, source="big.yaml", pos=p)


@pytest.mark.slow  # 4-5 s each: a scale test, not for the fast tier
@pytest.mark.parametrize("factor", [False, True])
def test_100k_ops_render(big_plan: ir.Plan, factor: bool) -> None:
    # Its speed is measured in benchmarks/ (plan scale), not here.
    text = render_text(big_plan, factor_prefixes=factor)
    assert text.count("\n") > 100_000
