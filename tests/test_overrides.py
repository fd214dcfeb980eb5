"""`KEY=VALUE` overrides: paths, names of tasks and steps, step ids, typos, `+` keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_util import jobrun, logged

from jobrun.errors import PlanError, Pos
from jobrun.plans.compile import compile_file, compile_text
from jobrun.plans.load import PMap, load_text
from jobrun.plans.overrides import apply_sets

ROOT = Path(__file__).resolve().parent.parent
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

# Two tasks, nested steps of every kind, an id on an op and on a loop, a repeated op.
NESTED = """\
job: nested
max_epochs: 2
init:
  - task: setup
    do:
      - const: {out: a, value: 0}
      - const: {out: flag, value: true}
epoch:
  - task: train
    do:
      - loop: 3
        id: inner
        do:
          - add: {in: [a, 1], out: a}
            id: bump
          - if: flag
            then:
              - mul: {in: [a, 2], out: a}
            else:
              - sub: {in: [a, 1], out: a}
      - parallel:
          - name: left
            do: [{fill: {out: l, shape: [2], value: 1.0}}]
          - do: [{fill: {out: r, shape: [2], value: 2.0}}]
      - add: {in: [a, 3], out: c}
    outputs: [a, c]
  - task: other.v2
    do:
      - const: {out: z, value: 1}
"""


def P(line: int, col: int) -> Pos:
    return Pos(F, line, col)


def sets(*items: str, text: str = PLAN) -> PMap:
    t = load_text(text, F)
    apply_sets(t, list(items))
    return t


def error_of(*items: str, text: str = PLAN) -> PlanError:
    with pytest.raises(PlanError) as info:
        sets(*items, text=text)
    return info.value


# -- values and index paths --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "value"),
    [("3", 3), ("0.05", 0.05), ("true", True), ("abc", "abc"), ("null", None), ("", None),
     ("'3'", "3"), ("[1, 2]", [1, 2]), ("-4", -4), ("1e-3", 0.001), (".inf", float("inf"))],
)
def test_set_values_are_yaml_values(raw: str, value: object) -> None:
    got = sets(f"++vars.lr={raw}")["vars"]["lr"]  # ++: any kind (a number var takes numbers)
    assert got == value and isinstance(got, type(value))
    assert isinstance(value, list) or type(got) is type(value)  # 1 is not True


@pytest.mark.parametrize("raw", ["fast", "true", "[1, 2]", "'0.5'"])
def test_a_number_var_refuses_another_kind_at_the_override(raw: str) -> None:
    # `vars.hidden=wide` passed, made a run directory and failed in the model's constructor
    # (TypeError: empty(): argument 'size' ... found element of type str).
    e = error_of(f"vars.lr={raw}")
    assert e.pos == P(4, 7) and "vars.lr is a number in the plan (0.1)" in e.message
    assert f"--set vars.lr={raw}" in e.message
    assert e.hint == f"give a number, e.g. vars.lr=0.1; ++vars.lr={raw} sets it anyway"


@pytest.mark.parametrize(("raw", "value"), [("3", 3), ("1e-3", 0.001), ("null", None)])
def test_a_number_var_takes_numbers_and_null(raw: str, value: object) -> None:
    assert sets(f"vars.lr={raw}")["vars"]["lr"] == value


def test_set_dotted_paths_and_list_indices() -> None:
    t = sets("max_epochs=7", "epoch.0.do.0.loop=20", "epoch.0.do.1.mul.in.1=2.5", "epoch.0.outputs.0=b")
    assert t["max_epochs"] == 7
    assert t["epoch"][0]["do"][0]["loop"] == 20
    assert t["epoch"][0]["do"][1]["mul"]["in"] == ["a", 2.5]
    assert t["epoch"][0]["outputs"] == ["b"]
    # An overridden value points at the override that gave it.
    assert t["epoch"][0]["do"][0].at("loop") == Pos("--set epoch.0.do.0.loop=20")
    assert t["epoch"][0]["do"][1]["mul"]["in"].at(1) == Pos("--set epoch.0.do.1.mul.in.1=2.5")
    assert t["epoch"][0]["do"][1]["mul"]["in"].at(0) == P(13, 20)


def test_set_later_wins() -> None:
    assert sets("max_epochs=1", "max_epochs=2")["max_epochs"] == 2


def test_set_reaches_the_compiled_plan() -> None:
    plan = compile_text(PLAN, F, sets=["max_epochs=9", "vars.lr=0.5", "epoch.0.do.0.loop=2"])
    assert plan.max_epochs == 9 and plan.vars["lr"] == 0.5
    assert plan.epoch.tasks[0].do[0].count == 2
    assert plan.epoch.tasks[0].do[1].ins[1].value == 0.5


# -- keys the plan lacks ---------------------------------------------------------------------


def test_optional_settings_the_schema_knows_need_no_plus() -> None:
    t = sets("seed=3", "device=cpu", "replicas=2", "stop_when=[a]", "checkpoint.keep=2",
             "checkpoint.best.monitor=a", "early_stop.monitor=a", "early_stop.patience=5",
             "epoch.0.instances=2", "epoch.0.do.0.id=outer", "epoch.0.do.1.id=x",
             text="job: x\nepoch:\n  - task: t\n    do:\n      - loop: 1\n        do: []\n      - mul: {in: [a, 2]}\n")
    assert t["seed"] == 3 and t["device"] == "cpu" and t["replicas"] == 2 and t["stop_when"] == ["a"]
    assert t["checkpoint"] == {"keep": 2, "best": {"monitor": "a"}}
    assert t["early_stop"] == {"monitor": "a", "patience": 5}
    assert t["epoch"][0]["instances"] == 2 and t["epoch"][0]["do"][0]["id"] == "outer"
    assert t["epoch"][0]["do"][1] == {"mul": {"in": ["a", 2]}, "id": "x"}
    assert isinstance(t["checkpoint"], PMap)
    # `mul` takes no argument `id`: an id beside the op's name is a step's key, not this
    assert "mul.id does not exist" in error_of(
        "epoch.0.do.0.mul.id=x", text="job: x\nepoch: [{task: t, do: [{mul: {in: [a, 2]}}]}]\n").message


@pytest.mark.parametrize(
    ("item", "message", "hint", "pos"),
    [
        ("vars.lrr=0.5", "vars.lrr does not exist in the plan", "did you mean 'vars.lr'?", P(4, 3)),
        ("max_epoch=3", "max_epoch does not exist in the plan", "did you mean 'max_epochs'", P(1, 1)),
        ("lr=0.05", "lr does not exist in the plan", "did you mean 'vars.lr'? (vars.lr=0.05)", P(1, 1)),
        ("vars.rate=0.5", "vars.rate does not exist", "vars has: lr, steps. To add a new key, write +vars.rate=0.5",
         P(4, 3)),
        ("epoch.0.do.1.mul.scale=2", "epoch.0.do.1.mul.scale does not exist", "+epoch.0.do.1.mul.scale=2",
         P(13, 14)),
        # checkpoint is not in the plan: the override made it
        ("checkpoint.kep=2", "checkpoint.kep does not exist", "did you mean 'checkpoint.keep'?",
         Pos("--set checkpoint.kep=2")),
    ],
)
def test_a_key_the_plan_and_its_schema_lack_is_a_typo(item: str, message: str, hint: str, pos: Pos) -> None:
    e = error_of(item)
    assert message in e.message and item in e.message and hint in e.hint, e.format_message()
    assert e.pos == pos, e.format_message()  # the mapping the key is missing from


def test_a_new_key_of_an_op_that_passes_any_key_on_is_offered_with_plus_beside_a_near_miss() -> None:
    """`build.dropout` is close to `build.out`, but build passes any key to its target:
    the hint says how to add it (plans/gpt.yaml's model takes a dropout it does not set)."""
    text = ("job: b\nmax_epochs: 1\ninit:\n  - task: setup\n    do:\n"
            "      - build: {out: model, target: torch.nn.Linear, in_features: 2, out_features: 1}\n"
            "epoch:\n  - task: t\n    do:\n      - const: {out: a, value: 1}\n")
    with pytest.raises(PlanError) as e:
        compile_text(text, F, sets=["init.setup.build.dropout=0.2"])
    assert "did you mean 'init.setup.build.out'?" in e.value.hint
    assert "To add a new key, write +init.setup.build.dropout=0.2" in e.value.hint
    # a near miss of an op that takes only its own keys stays a typo
    assert "+" not in error_of("epoch.0.do.1.mul.ot=b").hint


def test_plus_adds_a_new_key_and_refuses_an_existing_one() -> None:
    t = sets("+vars.warmup=100", "+vars.extra.deep=1", "+epoch.0.do.1.mul.note=x")
    assert t["vars"]["warmup"] == 100 and t["vars"]["extra"] == {"deep": 1}
    assert t["epoch"][0]["do"][1]["mul"]["note"] == "x"
    assert sets("+vars.new=1", text="job: x\n")["vars"] == {"new": 1}
    e = error_of("+vars.lr=0.5")
    assert "vars.lr already exists" in e.message and e.pos == P(4, 7)
    assert "drop the + to change it: vars.lr=0.5" in e.hint
    assert "+ only adds new keys" in error_of("+epoch.0.outputs.0=b").message
    # ++ adds or changes, whichever applies
    t = sets("++vars.lr=0.5", "++vars.extra=2", "++epoch.train.mul.note=x")
    assert t["vars"] == {"lr": 0.5, "steps": 4, "extra": 2} and t["epoch"][0]["do"][1]["mul"]["note"] == "x"


def test_plus_does_not_get_around_the_compiler() -> None:
    with pytest.raises(PlanError) as info:
        compile_text(PLAN, F, sets=["+max_epoch=3"])
    assert "unknown key 'max_epoch'" in info.value.message and "max_epochs" in info.value.hint


# -- tasks and steps by name ---------------------------------------------------------------


def test_tasks_and_ops_by_name_reach_nested_steps() -> None:
    t = sets("epoch.train.add.in.1=5", "epoch.train.mul.in.1=3", "epoch.train.sub.in.1=9",
             "epoch.other.v2.const.value=7", text=NESTED.replace("      - add: {in: [a, 3], out: c}\n", ""))
    do = t["epoch"][0]["do"]
    assert do[0]["do"][0]["add"]["in"] == ["a", 5]  # in a loop (by op name: one add left)
    assert do[0]["do"][1]["then"][0]["mul"]["in"] == ["a", 3]  # in an if, in the loop
    assert do[0]["do"][1]["else"][0]["sub"]["in"] == ["a", 9]
    assert t["epoch"][1]["do"][0]["const"]["value"] == 7  # a task name with a dot


def test_step_ids_name_ops_and_control_steps() -> None:
    t = sets("epoch.train.bump.in.1=2", "epoch.train.inner.loop=5", "epoch.train.inner.bump.out=d",
             text=NESTED)
    loop = t["epoch"][0]["do"][0]
    assert loop["loop"] == 5 and loop["do"][0]["add"] == {"in": ["a", 2], "out": "d"}
    plan = compile_text(NESTED, F, sets=["epoch.train.bump.in.1=2"])
    assert plan.epoch.tasks[0].do[0].id == "inner" and plan.epoch.tasks[0].do[0].body[0].id == "bump"


def test_an_op_argument_its_signature_knows_is_set_by_name(tmp_path: Path) -> None:
    # The example, on the bundled MLP plan: train.step is inside a loop.
    plan = compile_file(ROOT / "plans" / "mlp.yaml", ["epoch.train.train.step.clip_grad_norm=1.0"])
    step = plan.epoch.tasks[0].do[0].body[2]
    assert step.op == "train.step" and step.kwargs["clip_grad_norm"] == 1.0


def test_parallel_branches_and_elif_by_name_and_index() -> None:
    t = sets("epoch.train.split.parallel.left.do.0.fill.value=5", "epoch.0.do.1.parallel.1.do.0.fill.value=6",
             text=NESTED.replace("      - parallel:", "      - id: split\n        parallel:"))
    branches = t["epoch"][0]["do"][1]["parallel"]
    assert branches[0]["do"][0]["fill"]["value"] == 5 and branches[1]["do"][0]["fill"]["value"] == 6
    e = error_of("epoch.train.fill.value=9", text=NESTED)
    assert "'fill' names 2 steps" in e.message and "epoch.0.do.1.parallel.0.do.0.fill (p.yaml:23:19)" in e.message


def test_a_name_that_fits_several_steps_lists_them_with_index_paths() -> None:
    e = error_of("epoch.train.add.in.1=5", text=NESTED)
    assert "'add' names 2 steps of epoch.train" in e.message
    assert "epoch.0.do.0.do.0.add (p.yaml:14:13)" in e.message
    assert "epoch.0.do.2.add (p.yaml:25:9)" in e.message
    assert "`id:`" in e.hint


@pytest.mark.parametrize(
    ("item", "message", "hint"),
    [
        ("epoch.trian.add.in.1=5", "group `epoch` has no task 'trian'", "did you mean 'epoch.train'?"),
        ("epoch.train.ad.in.1=5", "epoch.train has no key or step named 'ad'", "did you mean 'epoch.train.add'"),
        ("epoch.train.inner.bmp.in=x", "epoch.train.inner has no key or step named 'bmp'", "'epoch.train.inner.bump'"),
        ("epoch.train.inner=3", "epoch.train.inner is a step, not a value", "epoch.train.inner.loop=..."),
        ("epoch.train.sub=3", "epoch.train.sub is a step, not a value", "epoch.train.sub."),
        ("epoch.train=3", "epoch.train is a task, not a value", "epoch.train.task=..."),
        # A path into an op step, wrong: the hint said "its steps: none" (an op step has none).
        ("epoch.0.do.2.ad.out=c", "epoch.0.do.2 has no key or step named 'ad'", "did you mean 'epoch.0.do.2.add'?"),
        ("epoch.0.do.2.nope=1", "epoch.0.do.2 has no key or step named 'nope'",
         "epoch.0.do.2 is the step `add`; its keys: add, id; `add`'s arguments go under it (epoch.0.do.2.add."),
        ("epoch.0.do.1.parallel.0.do.0.value=3", "has no key or step named 'value'",
         "did you mean 'epoch.0.do.1.parallel.0.do.0.fill.value'? (an op's arguments go under its name)"),
        ("epoch.train.dox.0=1", "epoch.train has no key or step named 'dox'", "did you mean 'epoch.train.do'?"),
        ("epoch.0.do.-1.add.out=c", "epoch.0.do has no step named '-1'", "or give the step's index (0 to 2)"),
    ],
)
def test_bad_names(item: str, message: str, hint: str) -> None:
    e = error_of(item, text=NESTED)
    assert message in e.message and hint in e.hint, e.format_message()


def test_step_ids_are_checked_by_the_compiler() -> None:
    dup = NESTED.replace("id: bump", "id: inner")
    with pytest.raises(PlanError) as info:
        compile_text(dup, F)
    assert "step id 'inner' appears twice in task 'train' (first at line 12" in info.value.message
    for bad, words in (("id: do", "'do' is a task key"), ("id: a.b", "bad step id 'a.b'"), ("id: 3", "the number 3")):
        with pytest.raises(PlanError) as info:
            compile_text(NESTED.replace("id: bump", bad), F)
        assert words in info.value.message, info.value.format_message()
    with pytest.raises(PlanError) as info:
        compile_text(NESTED.replace("          - add: {in: [a, 1], out: a}\n            id: bump\n",
                                    "          - id: bump\n"), F)
    assert "has an `id` but nothing to do" in info.value.message


@pytest.mark.parametrize(
    ("item", "pos", "words"),
    [
        ("max_epochs", Pos("--set max_epochs"), "not KEY=VALUE"),
        ("=3", Pos("--set =3"), "not KEY=VALUE"),
        ("+=3", Pos("--set +=3"), "not KEY=VALUE"),
        ("a..b=1", Pos("--set a..b=1"), "empty part"),
        ("+++vars.x=1", Pos("--set +++vars.x=1"), "key '+++vars.x' starts with '+++': only + or ++ may start a key"),
        ("+ +vars.x=1", Pos("--set + +vars.x=1"), "key '+ +vars.x' starts with '+ +': only + or ++ may start a key"),
        ("epoch.1.task=x", P(7, 3), "'epoch.1' does not exist"),
        ("epoch.-1.task=x", P(7, 3), "no task '-1'"),
        ("epoch.²=x", P(7, 3), "'epoch.²' does not exist"),
        ("max_epochs.x=1", P(2, 13), "max_epochs is the number 3"),
        ("vars.lr.x=1", P(4, 7), "no 'x'"),
        ("max_epochs=[1", Pos("--set max_epochs=[1"), "invalid YAML"),
        ("max_epochs=!!python/name:os.system", Pos("--set max_epochs=!!python/name:os.system"), "tag"),
    ],
)
def test_bad_sets(item: str, pos: Pos, words: str) -> None:
    e = error_of(item)
    assert e.pos == pos, e.format_message()
    assert words in e.message


# -- through the commands ------------------------------------------------------------------


def test_train_refuses_a_typo_before_writing_anything(plan_file, tmp_path: Path) -> None:
    path = plan_file((ROOT / "plans" / "counter.yaml").read_text())
    run = tmp_path / "run"
    r = jobrun("train", path, "--run-dir", run, "vars.limt=2")
    assert r.code == 2 and "vars.limt does not exist in the plan" in r.err
    assert "did you mean 'vars.limit'?" in r.err and "Traceback" not in r.text
    assert not run.exists()
    r = jobrun("train", path, "--run-dir", run, "--set", "vars.limt=2")
    assert r.code == 2 and "did you mean 'vars.limit'?" in r.err


def test_plus_keys_are_recorded_and_reapplied_on_resume(plan_file, tmp_path: Path) -> None:
    text = (ROOT / "plans" / "counter.yaml").read_text().replace('"${limit}"', '"${stop}"')
    path = plan_file(text)
    run = tmp_path / "run"
    # `stop` is a var the plan file does not define: added with +, used by the plan
    r = jobrun("train", path, "--run-dir", run, "+vars.stop=2", "max_epochs=1")
    assert r.code == 0, r.text
    assert json.loads((run / "run.json").read_text())["sets"] == ["+vars.stop=2", "max_epochs=1"]
    r = jobrun("resume", "--run-dir", run, "max_epochs=5")
    assert r.code == 0, r.text
    assert [v["epochs"] for v in logged(run, "counted")] == [1, 2]  # done at epoch 2, by vars.stop


def test_print_and_analyze_take_the_same_overrides(plan_file) -> None:
    path = plan_file(NESTED)
    r = jobrun("print", path, "--set", "epoch.train.inner.loop=7")
    assert r.code == 0 and "loop 7:  # id: inner" in r.out, r.text
    assert "a = add(a, 1)  # id: bump" in r.out
    r = jobrun("analyze", path, "--set", "epoch.train.bmp.in=x")
    assert r.code == 2 and "did you mean 'epoch.train.bump'" in r.err
    r = jobrun("analyze", path, "epoch.train.bmp.in=x")  # positional, as train takes them
    assert r.code == 2 and "did you mean 'epoch.train.bump'" in r.err
    r = jobrun("print", path, "epoch.train.inner.loop=6", "--format", "json")
    assert r.code == 0 and json.loads(r.out)["groups"][1]["tasks"][0]["do"][0]["count"] == 6


def test_a_resume_override_of_what_the_checkpoint_restores_says_it_has_no_effect(tmp_path: Path) -> None:
    # `resume vars.lr=0.01`: init builds the optimizer with 0.01, then the checkpoint puts
    # its saved lr back (as Lightning and HF Trainer do); the resume said "resuming with
    # ...optimizer.lr: 0.1 -> 0.01" as if it took effect. It now says that it does not.
    plan = tmp_path / "plan.yaml"
    plan.write_text("""\
job: fit
seed: 0
max_epochs: 1
vars: {lr: 0.1}
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 4, classes: 2, seed: 0}
      - model.mlp: {out: model, sizes: [4, 2]}
      - optimizer: {in: model, out: opt, lr: "${lr}"}
epoch:
  - task: train
    do:
      - train.step: {in: [model, opt, x, y], out: loss}
      - log: {in: [loss]}
    outputs: [loss]
""")
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    r = jobrun("resume", run, "vars.lr=0.01", "max_epochs=2")
    assert r.code == 0, r.text
    said = ("warning: init.0.do.2.optimizer.lr: 0.1 -> 0.01 has no effect: checkpoint epoch 1 restores "
            "'opt' with its saved state")
    assert said in r.err and said in (run / "console.log").read_text(), r.err
    assert "max_epochs: 1 -> 2 has no effect" not in r.err


VARS_PLAN = """\
job: demo
vars: {batch: 8, epochs: 2, half: "${batch}", loss: cross_entropy}
max_epochs: "${epochs}"
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 64, features: 4, classes: 2}
      - reader: {in: [x, y], out: data, batch_size: "${half}"}
      - model.mlp: {out: model, sizes: [4, 2]}
      - optimizer: {in: model, out: opt, lr: 0.1}
epoch:
  - task: train
    do:
      - read: {in: data, out: [xb, yb, end]}
      - train.step: {in: [model, opt, xb, yb], out: loss, loss: "${loss}"}
    outputs: [loss]
"""


@pytest.mark.parametrize(("item", "line"), [
    ("vars.batch=0", 8),  # through `half: ${batch}`
    ("vars.loss=seq_los", 15),
    ("vars.epochs=2.5", 3),  # refused by the compiler, not the analyzer
])
def test_a_bad_value_a_var_override_gave_names_the_override(plan_file, tmp_path: Path, item: str, line: int) -> None:
    # The message points at the plan line holding `${...}`, which looks right: the hint
    # says the value came from the override.
    path = plan_file(VARS_PLAN)
    for r in (jobrun("analyze", path, item), jobrun("train", path, "--run-dir", tmp_path / "run", item)):
        assert r.code in (1, 2) and f"{path}:{line}:" in r.text, r.text  # analyze: 1 for its findings
        assert f"The value here came from `{item}` on the command line" in r.text, r.text
    r = jobrun("analyze", path, "vars.batch=4", "vars.loss=seq_los")  # only where it was used
    assert "vars.batch=4" not in r.text and "`vars.loss=seq_los`" in r.text, r.text
