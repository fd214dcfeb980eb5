"""What checkpoints hold, worked out from the plan and the ops' signatures (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_util import jobrun

from jobrun.ops.registry import registry
from jobrun.ops.spec import OpSpec
from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_file, compile_text
from jobrun.plans.state import checkpointed

PLANS = Path(__file__).resolve().parent.parent / "plans"


@pytest.mark.parametrize(("name", "held"), [
    ("mlp", ("train_data", "model", "opt", "loss")),
    ("cnn", ("train_data", "model", "opt")),
    # vocab_size: `build` may keep what it is given, and train.step changes the model
    ("charlm", ("vocab_size", "train_data", "model", "opt", "sched")),
    ("counter", ("total", "epochs")),
])
def test_the_examples_hold_what_training_changes(name, held):
    assert checkpointed(compile_file(PLANS / f"{name}.yaml")) == {"local": held}


def _held(body: str, checkpoint: str = "{}", ops=None) -> tuple[str, ...]:
    plan = compile_text(f"job: t\nmax_epochs: 1\ncheckpoint: {checkpoint}\n{body}")
    return checkpointed(plan, ops)["local"]


INIT = """
init:
  - task: setup
    do:
      - const: {out: a, value: 1}
      - const: {out: b, value: 2}
      - const: {out: c, value: 3}
"""


def test_epoch_writes_reach_globals_but_private_blobs_are_not_saved():
    assert _held(INIT + """
epoch:
  - task: t
    do:
      - add: {in: [a, 1], out: a}       # a global blob: updated, saved
      - add: {in: [b, 1], out: tmp}     # a private blob: gone at the end of the task
      - loop: 2
        as: i
        do: [{log: {in: [c]}}]
""") == ("a",)


def test_a_global_epoch_task_creates_saved_blobs():
    assert _held(INIT + """
epoch:
  - task: t
    workspace: global
    do: [{add: {in: [a, 1], out: fresh}}]
""") == ("fresh",)


def test_call_changes_its_inputs_that_are_not_data_unless_it_says_which():
    init = INIT + """
      - model.mlp: {out: m, sizes: [2, 2]}
      - call: {fn: "m:load", out: tokens}
      - call: {fn: "m:load", out: fixed, pure: true}
      - call: {fn: "m:derive", in: [fixed], out: derived, pure: true}
"""
    epoch = """
epoch:
  - task: t
    do:
      - call: {{fn: "m:f", in: [a, b, m, tokens, fixed, derived]{mutates}}}
"""
    # a, b (const) and the results of pure calls are data: an undeclared call leaves them;
    # the model and an undeclared call's result may be changed by it.
    assert _held(init + epoch.format(mutates="")) == ("m", "tokens")
    assert _held(init + epoch.format(mutates=", mutates: []")) == ()
    assert _held(init + epoch.format(mutates=", mutates: [b]")) == ("b",)
    assert _held(init + epoch.format(mutates=", pure: true")) == ()


def test_a_pure_calls_result_holds_on_to_none_of_its_inputs():
    body = INIT + """
      - model.mlp: {out: m, sizes: [2, 2]}
epoch:
  - task: t
    workspace: global
    do:
      - call: {fn: "m:f", in: [m], out: kept}
      - call: {fn: "m:g", in: [m], out: free, pure: true}
"""
    assert _held(body) == ("m", "kept", "free")  # the undeclared call may change m
    assert _held(body.replace('out: kept}', 'out: kept, mutates: []}')) == ("m", "kept", "free")
    pure_only = body.replace('- call: {fn: "m:f", in: [m], out: kept}\n', "")
    assert _held(pure_only) == ("free",)


def test_a_private_batch_holds_its_token_stream_only_when_changed_in_place():
    """A nanoGPT get_batch as an undeclared `call` in a private epoch task: its batch is
    gone when the task ends, so the stream it was cut from is not saved (it was, in every
    checkpoint: GBs for a real corpus). Changed in place, the batch may change the
    stream it is a view of: then the stream is saved."""
    body = """
init:
  - task: setup
    do:
      - data.load: {out: tokens, path: train.bin, dtype: uint16}
epoch:
  - task: t
    do:
      - call: {fn: "batches:get_batch", in: [tokens], out: [xb, yb]}
      - log: {in: [xb]}
"""
    assert _held(body) == ()
    assert _held(body.replace("- log: {in: [xb]}", '- call: {fn: "m:noise_", in: [xb], mutates: [xb]}')) \
        == ("tokens",)
    assert _held(body.replace("  - task: t\n", "  - task: t\n    workspace: global\n")) \
        == ("tokens", "xb", "yb")  # saved batches hold on to the stream


def test_a_changed_object_changes_what_it_keeps():
    """scheduler.step sets the optimizer's learning rate: the optimizer is saved too."""
    body = """
init:
  - task: setup
    do:
      - model.mlp: {out: model, sizes: [2, 2]}
      - optimizer: {in: model, out: opt}
      - scheduler: {in: opt, out: sched, target: torch.optim.lr_scheduler.StepLR, step_size: 1}
      - data.synthetic: {out: [x, y], task: classification, n: 8, features: 2, classes: 2}
      - reader: {in: [x, y], out: r, batch_size: 4}
epoch:
  - task: t
    do:
      - scheduler.step: {in: sched}
      - read: {in: r, out: [xb, yb, end]}
"""
    # the optimizer keeps the model: stepping the scheduler reaches it (through the
    # optimizer), reading the reader does not reach its data
    assert _held(body) == ("model", "opt", "sched", "r")


def test_an_undeclared_users_op_changes_every_input():
    ops = {**registry(), "my.op": OpSpec("my.op", "doc", "m:f", inputs=("x", "y"), category="user")}
    assert _held(INIT + """
epoch:
  - task: t
    do: [{my.op: {in: [a, c]}}]
""", ops=ops) == ("a", "c")


def test_download_and_exit_run_after_the_last_save():
    assert _held(INIT + """
epoch:
  - task: t
    do: [{log: {in: [a]}}]
download:
  - task: d
    do: [{add: {in: [a, 1], out: a}}]
exit:
  - task: e
    do: [{add: {in: [b, 1], out: b}}]
""") == ()


def test_include_and_exclude_override_the_choice():
    epoch = "\nepoch:\n  - task: t\n    do: [{add: {in: [a, 1], out: a}}]\n"
    assert _held(INIT + epoch, "{include: [c, b], exclude: a}") == ("b", "c")


def test_an_unknown_name_in_include_is_warned_and_in_mutates_refused():
    """A typo in `mutates` (an EMA's `[eam]`) left what the call changes out of every
    checkpoint, and a resume silently gave another EMA: an error, not a warning."""
    plan = compile_text("""
job: t
max_epochs: 1
checkpoint: {include: [modle]}
init:
  - task: setup
    do: [{model.mlp: {out: model, sizes: [2, 2]}}]
epoch:
  - task: t
    do: [{call: {fn: "m:f", in: [model], mutates: [mdl]}}]
""")
    found = [(d.severity, d.code, d.message, d.hint) for d in analyze(plan)]
    assert ("warning", "checkpoint-blob", "checkpoint.include names blob 'modle', which no "
            "global workspace holds", "did you mean 'model'?") in found
    assert ("error", "checkpoint-blob", "`call` says it changes 'mdl', which is not one of its inputs",
            "did you mean 'model'?") in found


def test_a_call_whose_in_misspells_the_blob_mutates_names_is_told_to_fix_in():
    """`in: [emma, model], mutates: [ema]`: the hint named 'emma', a blob there is not, as
    what `mutates` should say; `ema` is the blob init made, and `in` misspells it."""
    plan = compile_text("""
job: t
max_epochs: 1
init:
  - task: setup
    do: [{model.mlp: {out: model, sizes: [2, 2]}}, {model.mlp: {out: ema, sizes: [2, 2]}}]
epoch:
  - task: t
    do: [{call: {fn: "m:f", in: [emma, model], mutates: [ema]}}]
""")
    hints = [d.hint for d in analyze(plan) if "says it changes 'ema'" in d.message]
    assert hints == ["did you mean 'ema' in `in`, where it says 'emma'?"]


def test_print_and_analyze_json_show_the_checkpointed_blobs():
    r = jobrun("print", PLANS / "cnn.yaml")
    assert "checkpointed @ local: [train_data, model, opt] + random state" in r.out.splitlines()
    r = jobrun("analyze", PLANS / "cnn.yaml", "--format", "json")
    assert json.loads(r.out)["checkpointed"] == {"local": ["train_data", "model", "opt"]}
