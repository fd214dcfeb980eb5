"""`jobrun schema`: the JSON Schema accepts every example plan and refuses broken ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from runner_util import HANG_S

from jobrun.ops.registry import registry
from jobrun.plans import keys as plan_keys
from jobrun.plans.load import load_file, load_text, to_plain
from jobrun.plans.schema import plan_schema

ROOT = Path(__file__).resolve().parent.parent
PLANS = sorted((ROOT / "plans").glob("*.yaml"))

GOOD = """
job: good
seed: "${seed}"
replicas: auto
vars: {seed: 1, steps: 3, bs: 4, name: w, one: 1}
max_epochs: 2
stop_when: done
early_stop: {monitor: m, mode: max, patience: 2, min_delta: 1e-3}
checkpoint: {dir: ckpt, every: 1, keep: null, upload: null, best: {monitor: m, mode: min, keep: 2}}
init:
  - task: setup
    do:
      - const: {out: x, value: [1.0, 2.0, 3.0, 4.0]}
      - reader: {in: x, out: data, batch_size: "${bs}", shuffle: true}
      - fill: {out: "enc/${name}", shape: [2, "${bs}"], value: 0.5}
      - copy:
          in: x
          out: x2
epoch:
  - task: train
    instances: "${one}"  # more: each instance's outputs would stay in it (analyze's error)
    init: null
    do:
      - loop: "${steps}"
        as: i
        id: outer
        do:
          - read: {in: data, out: [xb, done]}
          - mul: {in: [i, 10, 2.5, true, "${steps}"], out: m}
            id: scale
      - loop: null
        do: [{stop_if: done}]
      - loop: m
        do: []
      - if: done
        then: [{log: {in: [m]}}]
        elif: [{if: m, then: [{log: {in: m, msg: hi}}]}]
        else: [{log: }]
      - parallel:
          - {name: left, do: [{copy: {in: x, out: l}}]}
          - {do: [{copy: {in: x, out: r}}]}
      - report: 500ms
        do: [{log: {in: [m], msg: null}}]
      - call: {fn: "pkg.mod:f", in: [m], out: [], anything: [1, 2]}
    outputs: [done, m, l, r]
exit:
  - task: save
    node: local
    workspace: global
    do:
      - save: {in: [x], path: "${run_dir}/x.json"}
"""


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return plan_schema()


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> Draft202012Validator:
    return Draft202012Validator(schema)


def errors(validator: Draft202012Validator, plan: Any) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(plan)]


def test_schema_is_a_valid_draft_2020_12_schema(schema: dict[str, Any]) -> None:
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] and schema["title"] and schema["description"]


def test_schema_is_deterministic_json(schema: dict[str, Any]) -> None:
    assert json.dumps(plan_schema()) == json.dumps(schema)


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_example_plans_validate(validator: Draft202012Validator, path: Path) -> None:
    assert errors(validator, to_plain(load_file(path))) == []


def test_every_construct_and_vars_validate(validator: Draft202012Validator) -> None:
    assert errors(validator, to_plain(load_text(GOOD))) == []


def _good() -> dict[str, Any]:
    return to_plain(load_text(GOOD))


@pytest.mark.parametrize(
    ("step", "words"),
    [
        ({"id": "x"}, "does not have enough properties"),  # an id and nothing else
        ({"add": {"in": ["a", "b"], "out": "c"}, "mul": {"in": ["a", "b"], "out": "c"}}, "too many"),
        ({"add": {"in": ["a", "b"], "out": "c"}, "id": "a.b"}, "does not match"),
        ({"add": {"in": ["a", "b"], "out": "c"}, "id": "do"}, "should not be valid"),
        ({"loop": 2, "do": [], "id": 3}, "is not of type 'string'"),
    ],
)
def test_step_ids_in_the_schema(validator: Draft202012Validator, step: dict, words: str) -> None:
    plan = _good()
    plan["epoch"][0]["do"].append(step)
    found = errors(validator, plan)
    assert found and any(words in e for e in found), found


@pytest.mark.parametrize(
    ("key", "value"),
    [("early_stop", {"mode": "min"}), ("early_stop", {"monitor": "m", "mode": "up"}),
     ("early_stop", {"monitor": "m", "min_delta": -1}), ("early_stop", {"monitor": "m", "patiance": 3})],
)
def test_early_stop_in_the_schema(validator: Draft202012Validator, key: str, value: dict) -> None:
    plan = _good()
    plan[key] = value
    assert errors(validator, plan)


def _step(plan: dict[str, Any], i: int) -> dict[str, Any]:
    return plan["epoch"][0]["do"][i]


def _set(plan: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = plan
    for part in parents:
        node = node[part]
    node[last] = value
    return plan


@pytest.mark.parametrize(
    ("path", "value", "why"),
    [
        ("epochs", 3, "unknown top key"),
        ("max_epochs", "ten", "wrong type"),
        ("max_epochs", 0, "below the minimum"),
        ("seed", 1.5, "wrong type"),
        ("device", "gpu", "bad device"),
        ("replicas", "many", "bad replicas"),
        ("job", "a/b", "bad job name"),
        ("job", "${name}", "vars are not substituted in the job name"),
        ("vars", {"plan_dir": "x"}, "a built-in var redefined"),
        ("checkpoint", {"dir": "c", "every_epoch": 1}, "unknown checkpoint key"),
        ("checkpoint", {"keep": 0}, "keep below 1"),
        ("epoch", [], "no epoch tasks"),
        ("epoch.0.tasks", "t", "unknown task key"),
        ("epoch.0.workspace", "shared", "bad workspace"),
        ("epoch.0.instances", 0, "instances below 1"),
        ("epoch.0.do.0.loop", 1.5, "loop count not an integer"),
        ("epoch.0.do.0.times", 2, "unknown loop key"),
        ("epoch.0.do.0.do.0.read.in", "bad name!", "bad blob name"),
        ("epoch.0.do.0.do.0.read.out", [], "too few outputs"),
        ("epoch.0.do.0.do.1.mul.scale", 2, "unknown op arg"),
        ("epoch.0.do.0.do.1.mul.in", [None], "null in the input list"),
        ("epoch.0.do.0.do.1.mul.in", None, "no inputs for mul"),
        ("epoch.0.do.3.elif", [{"if": "m"}], "elif without then"),
        ("epoch.0.do.4.parallel.0.name", "a/b", "bad branch name"),
        ("epoch.0.do.5.report", "500", "duration without unit"),
        ("epoch.0.do.6", {"addd": {"in": [1, 2], "out": "c"}}, "unknown op"),
        ("epoch.0.do.6", {"add": {"in": [1, 2], "out": "c"}, "copy": None}, "two ops in one step"),
        ("epoch.0.do.6", "add", "a bare word"),
        ("epoch.0.do.6", {}, "an empty step"),
        ("init.0.do.0.const.out", None, "const without out"),
        ("init.0.do.1.reader.batch_size", "big", "wrong arg type"),
        ("init.0.do.1.reader.shuffle", "yes", "wrong arg type"),
        ("init.0.do.2.fill.shape", [2, -1], "negative dimension"),
        ("init.0.do.2.fill.dtype", "float8", "not one of the choices"),
        ("init.0.do.3.copy.in", ["a", "b"], "too many inputs"),
        ("exit.0.do.0.save.path", None, "path must be a string"),
    ],
)
def test_broken_plans_do_not_validate(
    validator: Draft202012Validator, path: str, value: Any, why: str
) -> None:
    plan = _set(_good(), path, value)
    assert errors(validator, plan), f"{why}: {path}={value!r} was accepted"


@pytest.mark.parametrize("key", ["job", "epoch"])
def test_required_top_keys(validator: Draft202012Validator, key: str) -> None:
    plan = _good()
    del plan[key]
    assert errors(validator, plan)


def test_missing_required_op_arg(validator: Draft202012Validator) -> None:
    plan = _good()
    del plan["init"][0]["do"][2]["fill"]["shape"]
    assert errors(validator, plan)


def test_errors_point_at_the_problem(validator: Draft202012Validator) -> None:
    plan = _set(_good(), "epoch.0.do.0.do.1.mul.scale", 2)
    error = best_match(validator.iter_errors(plan))
    assert "scale" in error.message


def test_yaml_with_an_unknown_key_is_refused(validator: Draft202012Validator) -> None:
    # The same check an editor makes on the file as written.
    text = "job: j\nmax_epoch: 3\nepoch: [{task: t, do: []}]\n"
    assert errors(validator, yaml.safe_load(text))


def test_keys_come_from_the_compiler(schema: dict[str, Any]) -> None:
    defs = schema["$defs"]
    assert tuple(schema["properties"]) == plan_keys.TOP_KEYS
    assert tuple(defs["task"]["properties"]) == plan_keys.TASK_KEYS
    assert tuple(defs["checkpoint"]["properties"]) == plan_keys.CHECKPOINT_KEYS
    control = {key: defs[key] for key in plan_keys.CONTROL_KEYS}
    # Every key is described for editors, none left with the placeholder.
    for props in (schema["properties"], defs["task"]["properties"], defs["checkpoint"]["properties"], control):
        for key, sub in props.items():
            assert sub.get("description") and "not described yet" not in sub["description"], key


def test_every_op_is_a_step(schema: dict[str, Any]) -> None:
    defs = schema["$defs"]
    assert set(defs["op_call"]["properties"]) == set(registry()) | {"id"}
    for name, spec in registry().items():
        op = defs[f"op:{name}"]
        assert op["description"].startswith(spec.doc), name
        assert op["additionalProperties"] is spec.extra_args, name
        for a in spec.args:
            assert a.name in op["properties"] and op["properties"][a.name]["description"], (name, a.name)


def test_cli_schema_prints_a_valid_schema(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "jobrun", "schema"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    Draft202012Validator.check_schema(printed)
    assert printed == json.loads(json.dumps(plan_schema()))
    out = tmp_path / "plan.schema.json"
    result = subprocess.run([*cmd, "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == printed


def test_schema_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from jobrun.plans.schema import plan_schema\n"
        "plan_schema()\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr


def test_the_good_plan_is_good() -> None:
    # The schema's idea of a good plan must agree with the compiler's and the analyzer's.
    from jobrun.plans.analyze import analyze
    from jobrun.plans.compile import compile_text

    diagnostics = analyze(compile_text(GOOD, "good.yaml"))
    assert [d.format() for d in diagnostics if d.severity == "error"] == []


TRAINING = """
job: mlp
max_epochs: 2
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 4, classes: 2}
      - model.mlp: {out: model, sizes: [4, 8, 2], activation: gelu, dropout: 0.1}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
epoch:
  - task: train
    do:
      - train.step: {in: [model, opt, x, y], out: loss, amp: null, clip_grad_norm: 1.0}
"""


def test_training_ops_validate(validator: Draft202012Validator) -> None:
    assert errors(validator, to_plain(load_text(TRAINING))) == []


@pytest.mark.parametrize(
    ("group", "step", "op", "key", "value"),
    [
        ("init", 1, "model.mlp", "activation", "swish"),  # not a choice
        ("init", 1, "model.mlp", "sizes", [4, 8.5, 2]),  # a shape holds integers
        ("init", 0, "data.synthetic", "task", "ranking"),
        ("epoch", 0, "train.step", "amp", "fp8"),
        ("epoch", 0, "train.step", "in", ["model", "opt"]),  # too few inputs (3: a dict batch)
    ],
)
def test_training_ops_refuse_bad_arguments(
    validator: Draft202012Validator, group: str, step: int, op: str, key: str, value: Any
) -> None:
    plan = to_plain(load_text(TRAINING))
    plan[group][0]["do"][step][op][key] = value
    assert errors(validator, plan), f"{op}.{key}={value!r} was accepted"
