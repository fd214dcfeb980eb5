"""`analyze`'s data checks (jobrun/plans/analyze_data.py) and the sizes argument types
refuse: each bad plan gets one diagnostic at the token to change, with the fix; plans
that are fine get none. `jobrun train` refuses the errors before it makes a run directory
(tests/test_train_early.py)."""

from __future__ import annotations

import textwrap

import pytest
from test_analyze import PLANS, ROOT, at, expect, only, run

from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_file

# A reader made in init and read to the end of a pass by every epoch: {reader} is the
# reader's extra arguments, {loop} the count of the epoch's loop.
DRAIN = """
job: drain
max_epochs: {epochs}
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: classification, n: 32, features: 4, classes: 2}}
      - reader: {{in: [x, y], out: data, batch_size: 8{reader}}}
epoch:
  - task: train
    do:
      - loop: {loop}
        do:
          - read: {{in: data, out: [xb, yb, end]}}
          - stop_if: end
          - log: {{in: [xb]}}
"""


def drain(epochs: int | str = 3, reader: str = "", loop: str = "null") -> str:
    return DRAIN.format(epochs=epochs, reader=reader, loop=loop)


# -- a reader that runs out -----------------------------------------------------------------


def test_a_reader_left_at_one_pass_that_every_epoch_drains_is_warned_at_the_reader() -> None:
    text = drain()
    d = only(text, "reader-passes")
    expect(d, "warning", at(text, "reader:", "reader"),
           ("reader 'data'", "made once, in init, with passes: 1 (the default)",
            f"(line {at(text, 'read:')[0]})", "only the first epoch gets batches", "train on nothing"),
           ("`passes: 0`", "make the reader in the epoch group"))


def test_a_read_with_more_outputs_than_its_reader_gives_is_an_error_at_the_first_extra() -> None:
    """It failed at run time ("op returned 3 value(s) for 4 outputs"), after the run
    directory was made; fewer outputs (no `done`) are fine."""
    text = drain(reader=", passes: 0").replace("out: [xb, yb, end]}", "out: [xb, yb, end, extra]}")
    d = only(text, "read-outputs")
    expect(d, "error", at(text, "read:", "extra"),
           ("read: reader 'data' gives 2 fields and then `done`", "at most 3 names, got 4"),
           ("remove 'extra' from `out`",))
    fewer = drain(reader=", passes: 0").replace("out: [xb, yb, end]}", "out: [xb, yb]}")
    assert "read-outputs" not in [d.code for d in run(fewer)]


@pytest.mark.parametrize("loop", ["null", "4"])
def test_a_read_whose_tested_done_gets_the_readers_last_field_is_an_error_at_it(loop: str) -> None:
    """A reader of 3 fields read into [xb, yb, end] gave `end` its third field, and
    `stop_if: end` said 'a tensor of shape (8,) has no single truth value', at run time."""
    text = drain(reader=", passes: 0", loop=loop).replace("in: [x, y], out: data", "in: [x, y, y], out: data")
    d = only(text, "read-outputs")
    expect(d, "error", at(text, "read:", "end"),
           ("read: reader 'data' gives 3 fields and then `done`, and `out` names 2 before 'end'",
            "'end' gets field 3, though a `stop_if` tests it as `done`"),
           ("name 3 fields, then `done`",))
    untested = text.replace("stop_if: end", "stop_if: xb")  # three fields, no `done`: fine
    assert "read-outputs" not in [d.code for d in run(untested)]


def test_a_reader_of_n_passes_is_warned_at_its_passes_when_the_job_may_run_longer() -> None:
    text = drain(epochs=5, reader=", passes: 2")
    d = only(text, "reader-passes")
    expect(d, "warning", at(text, "passes: 2", "2"),
           ("with passes: 2,", "only the first 2 epochs get batches"))
    assert "(the default)" not in d.message


@pytest.mark.parametrize("text", [
    drain(reader=", passes: 0"),  # reads on, pass after pass
    drain(epochs=1),  # one epoch, one pass
    drain(epochs=2, reader=", passes: 2"),  # a pass for every epoch
    drain(loop="4"),  # a counted loop need not reach the pass's end
    drain().replace("out: [xb, yb, end]", "out: [xb, yb]").replace("stop_if: end", "stop_if: xb"),
    drain().replace("init:\n  - task: setup\n    do:\n", "init:\n  - task: setup\n    do:\n"
                    "      - const: {out: none, value: 0}\n")
           .replace("epoch:\n  - task: train\n    do:\n", "epoch:\n  - task: train\n    do:\n"
                    "      - reader: {in: [x, y], out: data, batch_size: 8}\n"),  # made anew each epoch
    drain(epochs="10\nstop_when: [end]") + "    outputs: [end]\n",  # the job ends with the pass
], ids=["passes-0", "one-epoch", "a-pass-an-epoch", "counted-loop", "no-done", "made-in-epoch", "stop-when"])
def test_readers_that_do_not_run_out_are_not_warned(text: str) -> None:
    assert [d.format() for d in run(text)] == []


def test_random_windows_never_run_out() -> None:
    text = """
    job: windows
    max_steps: 100
    init:
      - task: setup
        do:
          - const: {out: tokens, value: 0}
          - reader: {in: tokens, out: data, window: 4, batch_size: 2, sample: random}
    epoch:
      - task: train
        do:
          - loop: null
            do:
              - read: {in: data, out: [xb, yb, end]}
              - stop_if: end
              - log: {in: [xb]}
    """
    assert [d.code for d in run(text)] == []
    assert [d.code for d in run(text.replace("sample: random", "sample: order"))] == ["reader-passes"]
    # shuffle and drop_last do nothing beside sample: random: said, at the key
    d = only(text.replace("sample: random", "sample: random, shuffle: true"), "reader-random")
    assert d.severity == "warning" and "`shuffle` does nothing with `sample: random`" in d.message
    assert d.pos.line == 8 and d.pos.col == 92 and "sample: order" in d.hint  # at shuffle
    assert [d.code for d in run(text.replace("sample: random", "sample: random, drop_last: true"))] == \
        ["reader-random"]


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_the_bundled_plans_give_no_warning(path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    assert [d.format() for d in analyze(compile_file(path.relative_to(ROOT)))] == []


# -- data.load arguments that cannot fit the file --------------------------------------------


def _load(args: str) -> str:
    return textwrap.dedent(f"""
    job: load
    max_epochs: 1
    epoch:
      - task: t
        do:
          - data.load: {{out: tokens, {args}}}
          - log: {{in: [tokens]}}
    """)


@pytest.mark.parametrize(("args", "token", "message", "hint"), [
    ("path: data/train.bin", "data/train.bin",
     "a .bin file is raw and needs its `dtype`, e.g. dtype: uint16 ('train.bin')", "uint16"),
    ("path: t.npy, dtype: uint16", "uint16", "`dtype` applies to raw .bin files only", "dtype is one of"),
    ("path: t.npz, columns: [a]", "[a]", "`columns` applies to .csv files only", "remove `columns`"),
    ("path: t.csv, mmap: true", "true", "only .bin and .npy files can be memory-mapped, not '.csv'", "mmap"),
    ("path: t.txt", "t.txt", "unsupported file type '.txt' for 't.txt'", ".safetensors"),
])
def test_data_load_arguments_that_cannot_fit_the_files_type(args, token, message, hint) -> None:
    text = _load(args)
    expect(only(text, "data-load"), "error", at(text, "data.load", token), (message,), (hint,))


def test_data_load_arguments_that_fit_are_fine() -> None:
    for args in ("path: t.bin, dtype: uint16", "path: t.npy, mmap: true", "path: t.csv, columns: [a]"):
        assert run(_load(args)) == [], args


# -- sizes and rates the op would refuse -------------------------------------------------------


@pytest.mark.parametrize(("op", "key", "bad", "expected"), [
    ("reader: {in: [x, y], out: data, batch_size: BAD}", "batch_size", "0", "an integer >= 1"),
    ("reader: {in: [x, y], out: data, passes: BAD}", "passes", "-1", "an integer >= 0"),
    ("reader: {in: [x, y], out: data, num_workers: BAD}", "num_workers", "-2", "an integer >= 0"),
    ("optimizer: {in: model, out: opt, lr: BAD}", "lr", "-0.1", "a number >= 0"),
    ("data.synthetic: {out: [a, b], task: regression, n: BAD, features: 4}", "n", "0", "an integer >= 1"),
    ("train.step: {in: [model, opt, x, y], out: loss, accumulate: BAD}", "accumulate", "0", "an integer >= 1"),
    ("train.step: {in: [model, opt, x, y], out: loss, clip_grad_norm: BAD}", "clip_grad_norm", "0", "a number > 0"),
    ("data.synthetic: {out: [a, b], task: classification, n: 4, features: 4, classes: BAD}", "classes", "1",
     "an integer >= 2"),
])
def test_a_size_or_rate_out_of_range_is_refused_at_its_value(op, key, bad, expected) -> None:
    text = textwrap.dedent(f"""
    job: sizes
    max_epochs: 1
    vars: {{v: {bad}}}
    init:
      - task: setup
        do:
          - data.synthetic: {{out: [x, y], task: classification, n: 32, features: 4, classes: 2}}
          - model.mlp: {{out: model, sizes: [4, 2]}}
          - optimizer: {{in: model, out: opt, lr: 0.1}}
          - {op.replace("BAD", '"${v}"')}
    epoch:
      - task: train
        do:
          - log: {{in: [x]}}
    """)
    d = next(d for d in run(text) if d.code == "arg-type")
    line = op.split(":")[0] + ":"  # the op's second line when setup makes one of its own
    where = at(text, line, '"${v}"', nth=2 if op.startswith(("data.", "optimizer")) else 1)
    expect(d, "error", where, (f"argument `{key}`", f"is {bad}", f"expected {expected}"),
           (f"give `{key}` {expected}",))


def test_the_schema_gives_the_same_minimums() -> None:
    from jobrun.plans.schema import plan_schema

    text = str(plan_schema())
    assert "'minimum': 1" in text and "'minimum': 2" in text and "'exclusiveMinimum': 0" in text


@pytest.mark.parametrize(("t", "bound"), [
    ("int>=1", ("int", ">=", 1.0)), ("number>0", ("number", ">", 0.0)), ("number>=-1.5", ("number", ">=", -1.5)),
    ("int", None), ("int>=", None), ("float>=1", None), (("or", "int>=1", "null"), None),
])
def test_bounded_types_are_read_from_their_name(t, bound) -> None:
    from jobrun.ops.spec import bounded

    assert bounded(t) == bound


def test_a_plan_with_the_smallest_sizes_is_fine() -> None:
    text = """
    job: small
    max_epochs: 1
    init:
      - task: setup
        do:
          - data.synthetic: {out: [x, y], task: classification, n: 1, features: 1, classes: 2}
          - reader: {in: [x, y], out: data, batch_size: 1, passes: 0, num_workers: 0}
    epoch:
      - task: train
        do:
          - read: {in: data, out: [xb, yb]}
          - log: {in: [xb, yb]}
    """
    assert [d.code for d in run(text) if d.severity == "error"] == []


def test_a_misspelt_choice_that_may_also_be_null_gets_did_you_mean() -> None:
    text = """
    job: optim
    max_epochs: 1
    init:
      - task: setup
        do:
          - model.mlp: {out: model, sizes: [4, 2]}
          - optimizer: {in: model, out: opt, class: AdamWW}
    epoch:
      - task: train
        do:
          - log: {in: [opt]}
    """
    expect(only(text, "arg-type"), "error", at(text, "class:", "AdamWW"),
           ("argument `class` of `optimizer` is 'AdamWW'",), ("did you mean 'AdamW'?",))


# -- a training loop's first iteration ------------------------------------------------------

# The training loop most plans have: {reader} is the reader's extra arguments, {body} steps
# added to the loop after train.step, {after} steps after the loop.
TRAIN = """
job: idiom
max_epochs: 3
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: classification, n: 32, features: 4, classes: 2}}
      - reader: {{in: [x, y], out: data, batch_size: 8{reader}}}
      - model.mlp: {{out: model, sizes: [4, 2]}}
      - optimizer: {{in: model, out: opt, lr: 0.1}}
epoch:
  - task: train
    do:
      - loop: null
        do:
          - read: {{in: data, out: [xb, yb, end]}}
          - stop_if: end
          - train.step: {{in: [model, opt, xb, yb], out: loss}}{body}
      - evaluate: {{in: [model, data], out: [val_loss, accuracy]}}{after}
      - log: {{in: [loss, val_loss, accuracy]}}
    outputs: [loss]
"""


def train(reader: str = ", passes: 0", body: str = "", after: str = "") -> str:
    return TRAIN.format(reader=reader, body=body, after=after)


def test_the_training_loop_over_a_reader_that_reads_on_is_not_warned() -> None:
    """A pass always has a batch (the reader refuses one without), so the stop_if on the
    `done` of a `passes: 0` reader's only `read` does not end the loop's first iteration:
    `loss` is defined after it. Every bundled plan had a dummy `const` for it."""
    assert [d.format() for d in run(train())] == []


@pytest.mark.parametrize("text", [
    train(reader=""),  # passes: 1: the second epoch's read ends at once
    train(reader=", passes: 2"),
    train().replace("loop: null", "loop: 3"),  # a count ends the loop mid-pass or at its end
    train().replace("stop_if: end", "stop_if: stop").replace(
        "end]}}\n", "end]}}\n          - not: {in: [end], out: go}\n          - not: {in: [go], out: stop}\n"),
    train(body="\n          - gt: {in: [loss, 9.0], out: diverged}\n          - stop_if: diverged"),
    train(body="\n          - gt: {in: [loss, 9.0], out: diverged}\n          - if: diverged\n"
               "            then: [{stop_if: diverged}]"),
    train(after="\n      - read: {in: data, out: [xa, ya]}\n      - log: {in: [xa, ya]}"),  # may stop at a pass's end
    train().replace("out: [val_loss, accuracy]}", "out: [val_loss, accuracy], batches: 2}"),
    train().replace("max_epochs: 3", "max_epochs: 3\nmax_steps: 8"),  # max_steps cuts the loop anywhere
    train().replace("read: {in: data, out: [xb, yb, end]}", "read: {in: data, out: [xb, yb, end], every: 2}"),
], ids=["passes-1", "passes-2", "counted", "another-blob", "second-stop", "stop-in-if", "second-read",
        "evaluate-batches", "max-steps", "read-every"])
def test_a_loop_whose_first_iteration_may_stop_still_warns(text: str) -> None:
    diags = [d for d in run(text) if d.code == "maybe-undefined" and "'loss'" in d.message]
    assert [d.pos.line for d in diags] == [at(text, "log: {in: [loss")[0], at(text, "outputs:")[0]], \
        "\n".join(d.format() for d in run(text))
    assert all("is defined after the stop_if at line" in d.message for d in diags)


def test_instances_sharing_the_reader_still_warn() -> None:
    """One instance can take a pass's last batch and leave its `done` to another."""
    text = train().replace("  - task: train\n", "  - task: train\n    instances: 2\n")
    assert "maybe-undefined" in [d.code for d in run(text)]
