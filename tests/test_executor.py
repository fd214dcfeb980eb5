"""The executor in process: generated blocks, workspaces, error positions, bound ops."""

from __future__ import annotations

import re
import textwrap
import traceback

import pytest

from jobrun.errors import RunError
from jobrun.ops.context import OpContext
from jobrun.plans.compile import compile_text
from jobrun.runner.codegen_task import OpFailed, shared_names
from jobrun.runner.executor import CompiledTask, NodeRuntime, _private_workspace


def run(text: str, known: bool = True) -> tuple[dict, dict]:
    """Run the plan's init and one epoch in this process: (global workspace, outputs).
    ``known``: the tasks know which names the global workspace can hold, as the runner's
    do (else every store of a private task tests G)."""
    plan = compile_text(textwrap.dedent(text), "plan.yaml")
    node = NodeRuntime("local", OpContext())
    shared = shared_names(plan)["local"] if known else None
    outputs = {}
    for group in (plan.init, plan.epoch):
        for task in group.tasks:
            outputs[task.name] = CompiledTask(task, node, shared=shared).run()
    return node.globals, outputs


HEADER = """
job: t
init:
  - task: setup
    do:
      - const: {out: total, value: 0}
      - const: {out: q, value: 0}
      - const: {out: i, value: 0}
      - call: {fn: "builtins:divmod", in: [7, 2], out: [g1, g2]}
"""


def test_ops_with_literals_arguments_and_several_outputs():
    g, out = run(HEADER + """
epoch:
  - task: work
    do:
      - call: {fn: "builtins:divmod", in: [17, 5], out: [q, r]}  # q is global, r new
      - add: {in: [total, r, 10], out: total}
      - call: {fn: "builtins:divmod", in: [9, 4], out: [a, b]}
      - call: {fn: "jobrun_test_helpers:new_list", out: items}
      - call: {fn: "jobrun_test_helpers:append", in: [items, a]}  # no outputs
      - call: {fn: "jobrun_test_helpers:append", in: [items, 1]}
      - call: {fn: "builtins:sorted", in: [items], reverse: true, out: [hi, lo]}  # a list
    outputs: [r, a, b, items, hi, lo]
""")
    assert (g["g1"], g["g2"]) == (3, 1)  # a global task's several outputs
    assert g["q"] == 3 and g["total"] == 12  # writes to global names update them
    assert not {"r", "a", "b", "items"} & set(g)  # new names stayed in the task
    assert out["work"] == {"r": 2, "a": 2, "b": 1, "items": [2, 1], "hi": 2, "lo": 1}


def test_a_name_only_a_later_global_task_writes_stays_private_until_it_does():
    text = HEADER + """
epoch:
  - task: work
    do:
      - call: {fn: "builtins:divmod", in: [17, 5], out: [q, late]}  # late: not yet in G
      - add: {in: [q, 1], out: alone}  # no global task writes it: stored without a test
    outputs: [late, alone]
  - task: publish
    workspace: global
    do:
      - const: {out: late, value: 9}
"""
    for known in (True, False):  # the same blobs whether the tasks know G's names or not
        g, out = run(text, known)
        assert out["work"] == {"late": 2, "alone": 4} and g["q"] == 3 and g["late"] == 9
        assert "alone" not in g
    plan = compile_text(textwrap.dedent(text), "plan.yaml")
    assert shared_names(plan) == {"local": frozenset({"total", "q", "i", "g1", "g2", "late"})}
    node = NodeRuntime("local", OpContext())
    task = next(t for t in plan.epoch.tasks if t.name == "work")
    compiled = CompiledTask(task, node, shared=shared_names(plan)["local"])
    source = "".join(__import__("linecache").getlines(compiled._do.__code__.co_filename))
    assert "'late' in G" in source and "'alone' in G" not in source  # only what G can hold is tested


def test_loop_stops_at_stop_if_and_a_private_task_reads_through():
    g, out = run(HEADER + """
epoch:
  - task: count
    do:
      - loop: null
        do:
          - add: {in: [i, 1], out: i}
          - ge: {in: [i, 3], out: enough}
          - stop_if: enough
      - mul: {in: [i, 10], out: scaled}
    outputs: [scaled, enough]
""")
    assert g["i"] == 3 and out["count"] == {"scaled": 30, "enough": True}


@pytest.mark.parametrize("workspace", ["private", "global"])
def test_loops_and_stop_if_in_every_kind_of_block(workspace):
    g, out = run(HEADER + f"""
  - task: counts
    do:
      - const: {{out: three, value: 3}}
      - const: {{out: inner, value: 0}}
epoch:
  - task: work
    workspace: {workspace}
    do:
      - loop: three            # a count from a blob
        as: k
        do:
          - add: {{in: [total, k], out: total}}
      - loop: 2                # an index named like a global blob: written there
        as: i
        do: []
      - const: {{out: n, value: 0}}
      - loop: null
        do:
          - add: {{in: [n, 1], out: n}}
          - ge: {{in: [n, 4], out: enough}}
          - stop_if: enough    # ends the loop, not the task
          - add: {{in: [q, 1], out: q}}
      - loop: 0
        do:
          - add: {{in: [q, 100], out: q}}
      - loop: 3
        do:
          - if: enough
            then: [{{add: {{in: [q, 10], out: q}}}}]
      - loop: 2                # a stop_if in a nested loop ends the inner loop only
        do:
          - loop: 5
            do:
              - add: {{in: [inner, 1], out: inner}}
              - if: enough     # inside an if: still the innermost loop
                then: [{{stop_if: enough}}]
      - stop_if: enough        # ends the task's do
      - const: {{out: after, value: 1}}
    exit:
      - const: {{out: exited, value: 1}}  # runs after a stop_if
    outputs: [k, n, exited]
""")
    assert g["total"] == 0 + 1 + 2 and g["i"] == 1 and g["q"] == 3 + 30 and g["inner"] == 2
    assert "after" not in g and out["work"] == {"k": 2, "n": 4, "exited": 1}


def test_the_generated_source_names_its_ops_and_plan_lines():
    import linecache

    run(HEADER + """
epoch:
  - task: shown
    do:
      - loop: null
        do:
          - add: {in: [total, 1], out: total}
          - ge: {in: [total, 3], out: enough}
          - stop_if: enough
      - stop_if: enough
""")
    (source,) = [v[2] for k, v in linecache.cache.items() if "task 'shown'" in k][-1:]
    body = [line.rstrip("\n") for line in source if "# plan.yaml:" in line]
    assert any(re.fullmatch(r"for i\d+ in it\d+:  # plan.yaml:14 loop", line.strip()) for line in body)
    assert any(re.search(r"= op\d+_add\(ctx, L\['total'\], lit\d+\)  # plan.yaml:16 add$", line) for line in body)
    assert [line.strip() for line in body if "stop_if" in line and ":" not in line.split("#")[0]] == [
        "break  # plan.yaml:18 stop_if enough",  # in a loop: leaves it
        "return True  # plan.yaml:19 stop_if enough",  # outside any loop: ends the `do`
    ]
    # Every line of a step says where in the plan it comes from (the rest is the
    # function's frame: def, try, the handler and an empty section's `pass`).
    frame = {"pass", "raise", "failed(e)"}
    steps = [line for line in source if line.startswith("        ") and line.strip() not in frame]
    assert len(steps) > 10 and all(re.search(r"  # plan.yaml:\d+ \S", line) for line in steps)


def _shown(monkeypatch, text: str) -> tuple[dict, dict]:
    """Run the plan's epoch (its `jobrun_test_helpers:shown_step` calls record what the
    live display shows) in a node whose display is the one they read."""
    import jobrun_test_helpers

    from jobrun.runner.display import Display

    display = Display(enabled=False, tty=False)
    monkeypatch.setattr(jobrun_test_helpers, "DISPLAY", display)
    plan = compile_text(textwrap.dedent(text), "plan.yaml")
    node = NodeRuntime("local", OpContext(progress=display.progress))
    outputs = {task.name: CompiledTask(task, node).run() for task in plan.epoch.tasks}
    return node.globals, outputs


def test_the_display_shows_the_innermost_running_loop_and_then_its_outer_one_again(monkeypatch):
    _, out = _shown(monkeypatch, """
        job: t
        epoch:
          - task: nest
            do:
              - call: {fn: "jobrun_test_helpers:new_list", out: seen}
              - loop: 3
                do:
                  - loop: 2
                    do:
                      - call: {fn: "jobrun_test_helpers:shown_step", in: [seen]}
                  - call: {fn: "jobrun_test_helpers:shown_step", in: [seen]}
              - loop: null
                do:
                  - call: {fn: "jobrun_test_helpers:shown_step", in: [seen]}
                  - call: {fn: "builtins:len", in: [seen], out: k}
                  - ge: {in: [k, 11], out: enough}
                  - stop_if: enough
            outputs: [seen]
        """)
    seen = out["nest"]["seen"]
    assert seen == [(1, 2), (2, 2), (1, 3), (1, 2), (2, 2), (2, 3), (1, 2), (2, 2), (3, 3),
                    (1, None), (2, None)]


def test_a_reports_loops_are_never_what_the_display_shows(monkeypatch):
    # A report runs beside the training loop, in a thread: its loop must not take the
    # display's place (the training loop writes its entry once, as it starts).
    _, out = _shown(monkeypatch, """
        job: t
        epoch:
          - task: busy
            do:
              - call: {fn: "jobrun_test_helpers:new_list", out: seen}
              - report: 2ms
                do:
                  - loop: 2
                    do:
                      - const: {out: tick, value: 1}
              - loop: 5
                do:
                  - call: {fn: "time:sleep", in: [0.03]}
                  - call: {fn: "jobrun_test_helpers:shown_step", in: [seen]}
            outputs: [seen]
        """)
    seen = out["busy"]["seen"]
    assert seen == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]


def test_when_a_parallel_branchs_loop_ends_the_display_shows_the_one_still_running(monkeypatch):
    g, _ = _shown(monkeypatch, """
        job: t
        epoch:
          - task: both
            workspace: global
            do:
              - call: {fn: "jobrun_test_helpers:new_list", out: seen}
              - parallel:
                  - do:
                      - loop: 6
                        do:
                          - call: {fn: "time:sleep", in: [0.05]}
                          - call: {fn: "jobrun_test_helpers:shown_step", in: [seen]}
                  - do:
                      - call: {fn: "time:sleep", in: [0.01]}  # starts after the long one
                      - loop: 2
                        do:
                          - call: {fn: "time:sleep", in: [0.005]}
        """)
    # the short loop, shown from its start, ended within 20 ms; from the long one's third
    # step (100 ms) on, the long one is shown again
    assert g["seen"][2:] == [(3, 6), (4, 6), (5, 6), (6, 6)]


def test_a_stop_if_in_a_parallel_branch_acts_at_the_parallel():
    g, out = run(HEADER + """
epoch:
  - task: work
    do:
      - const: {out: stop, value: true}
      - loop: 3
        do:
          - add: {in: [total, 1], out: total}
          - parallel:
              - {do: [{stop_if: stop}]}            # leaves the loop around the parallel
              - {do: [{add: {in: [q, 1], out: q}}]}
      - add: {in: [i, 1], out: i}
""")
    assert g["total"] == 1 and g["q"] == 1 and g["i"] == 1


def test_a_report_runs_once_more_when_its_block_is_left_by_stop_if():
    _, out = run(HEADER + """
epoch:
  - task: work
    do:
      - call: {fn: "jobrun_test_helpers:new_list", out: seen}
      - const: {out: stop, value: true}
      - loop: 2
        do:
          - report: 3600s                        # never by its period here
            do:
              - call: {fn: "jobrun_test_helpers:append", in: [seen, 1]}
          - stop_if: stop
    outputs: [seen]
""")
    assert out["work"] == {"seen": [1]}  # the loop ended in its first iteration


@pytest.mark.parametrize("body", ["- add: {in: [total, 1], out: total}",
                                  "- if: total\n            then: [{add: {in: [total, 1], out: total}}]"],
                         ids=["inline", "closure"])
@pytest.mark.parametrize(("count", "message"), [
    ("-1", "loop count is -1, not a non-negative integer"),
    ("1.5", "loop count is 1.5, not a non-negative integer"),
    ("null", "loop count is null, not a non-negative integer"),
    ("missing", "loop count: blob 'missing' is not defined on node 'local'"),
])
def test_a_bad_loop_count_is_reported_at_the_loop(count, message, body):
    step = "      - loop: c"
    text = f"""
epoch:
  - task: work
    do:
      - const: {{out: c, value: {count}}}
{step}
        do:
          {body}
"""
    if count == "missing":
        text = text.replace("      - const: {out: c, value: missing}\n", "").replace("loop: c", "loop: missing")
        step = "      - loop: missing"
    e, line = _failure(text, step)
    assert not isinstance(e, OpFailed) and message in str(e) and e.pos.line == line
    if count != "missing":  # the hint says what to give the blob
        assert e.hint is not None and "give blob 'c' a whole number >= 0" in e.hint


def _failure(text: str, step: str) -> tuple[BaseException, int]:
    """The error of running the plan, and the line of `step` in it."""
    plan = HEADER + text
    with pytest.raises(RunError) as caught:
        run(plan)
    return caught.value, textwrap.dedent(plan).splitlines().index(step) + 1


def test_a_failing_op_is_reported_at_its_position_from_inside_a_loop():
    step = '          - call: {fn: "jobrun_test_helpers:fail"}'
    e, line = _failure("""
epoch:
  - task: work
    do:
      - loop: 2
        do:
          - add: {in: [total, 1], out: total}
""" + step + "\n", step)
    assert isinstance(e, OpFailed) and e.pos is not None and e.pos.line == line
    assert "op `call` in task 'work' on node 'local' failed: ValueError: boom" in str(e)
    assert isinstance(e.__cause__, ValueError)
    # A traceback through a generated block shows its source line.
    assert "(ctx, fn=kw" in "".join(traceback.format_exception(e.__cause__))


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ('call: {fn: "builtins:divmod", in: [7, 2], out: [a, b, c]}', "op returned 2 value(s) for 3 outputs"),
        ('call: {fn: "builtins:abs", in: [-2], out: [a, b]}', "op returned 1 value(s) for 2 outputs"),
        ("add: {in: [nothing, 1], out: a}", "blob 'nothing' is not defined"),
    ],
)
def test_op_errors_name_the_op_and_the_problem(step, message):
    e, line = _failure(f"""
epoch:
  - task: work
    do:
      - add: {{in: [total, 1], out: total}}
      - {step}
""", f"      - {step}")
    assert isinstance(e, OpFailed) and message in str(e) and e.pos.line == line
    if "value(s) for" in message:  # how to make them agree, for the ops users miscount most
        assert "one name for each value" in e.hint and "a `read` gives its reader's fields, then `done`" in e.hint


def test_an_undefined_elif_condition_is_reported_at_its_branch():
    step = "        elif: [{if: nothing, then: []}]"
    e, line = _failure("""
epoch:
  - task: work
    do:
      - const: {out: nope, value: false}
      - if: nope
        then: []
""" + step + "\n", step)
    assert not isinstance(e, OpFailed) and e.pos.line == line
    assert "if: blob 'nothing' is not defined on node 'local'" in str(e)


def test_a_key_error_inside_an_op_is_the_op_failing_not_an_undefined_blob():
    step = '      - call: {fn: "operator:getitem", in: [d, 1]}'
    e, line = _failure("""
epoch:
  - task: work
    do:
      - call: {fn: "builtins:dict", out: d}
""" + step + "\n", step)
    assert isinstance(e, OpFailed) and e.pos.line == line
    assert "op `call` in task 'work' on node 'local' failed: KeyError: 1" in str(e)


def test_stop_if_over_an_undefined_blob_is_a_run_error_of_its_own():
    e, _ = _failure("""
epoch:
  - task: work
    do:
      - loop: 3
        do:
          - stop_if: nothing
""", "          - stop_if: nothing")
    assert not isinstance(e, OpFailed) and e.__suppress_context__
    assert "stop_if: blob 'nothing' is not defined on node 'local'" in str(e)


def test_private_workspace_reads_its_own_names_first_then_the_global_ones():
    g = {"model": 1}
    local = _private_workspace(g)
    local["xb"] = 2
    g["late"] = 3  # created after the workspace: still read through
    assert (local["model"], local["xb"], local["late"]) == (1, 2, 3)
    local["model"] = 4  # written locally before: the task's own value is read first
    g["model"] = 5
    assert local["model"] == 4 and "late" not in local
    with pytest.raises(KeyError, match="nothing"):
        local["nothing"]


MEAN = """
job: t
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 56, features: 4, classes: 2, seed: 0}
      - reader: {in: [x, y], out: data, batch_size: 8, passes: 0}
      - model.mlp: {out: model, sizes: [4, 8, 2]}
      - optimizer: {in: model, out: opt, lr: 0.5}
epoch:
  - task: train
    do:
      - call: {fn: "jobrun_test_helpers:new_list", out: each}
      - loop: 7
        do:
          - read: {in: data, out: [xb, yb]}
          - train.step: {in: [model, opt, xb, yb], out: loss}
          - call: {fn: "jobrun_test_helpers:append", in: [each, loss_last]}
    outputs: [loss, loss_last, each]
"""


@pytest.mark.parametrize("block", [1024, 3])
def test_a_loop_of_train_steps_leaves_the_mean_of_their_losses(block, monkeypatch):
    """torch's sum of the stacked losses over their number, summed by blocks of
    MEAN_BLOCK steps in a long loop (so that it keeps at most a block of losses)."""
    import torch

    from jobrun.runner import codegen_runtime

    monkeypatch.setattr(codegen_runtime, "MEAN_BLOCK", block)
    _, out = run(MEAN)
    each = out["train"]["each"]
    loss = out["train"]["loss"]
    assert len(each) == 7 and len({float(v) for v in each}) == 7 and out["train"]["loss_last"] is each[-1]
    assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float32 and loss.dim() == 0
    sums = [torch.stack(each[k:k + block]).sum() for k in range(0, 7, block)]
    expected = (sums[0] if len(sums) == 1 else torch.stack(sums).sum()) / 7
    assert torch.equal(loss, expected)  # bit for bit
    assert float(loss) == pytest.approx(sum(float(v) for v in each) / 7, rel=1e-6)


@pytest.mark.parametrize(("value", "truth"), [
    ("true", True), ("false", False), ("null", False), ("0", False), ("1", True), ("0.0", False),
    ("2.5", True), ("''", False), ("'x'", True)])
def test_if_and_stop_if_test_a_blob_as_its_truth(value, truth):
    """The generated test of a condition: a bool without a call, null false, any other
    value by its truth (a one-element tensor by its value: test_core_ops)."""
    g, out = run(f"""
job: t
init:
  - task: setup
    do:
      - const: {{out: c, value: {value}}}
      - const: {{out: n, value: 0}}
epoch:
  - task: t
    do:
      - if: c
        then: [{{const: {{out: branch, value: then}}}}]
        else: [{{const: {{out: branch, value: else}}}}]
      - loop: 3
        do:
          - add: {{in: [n, 1], out: n}}
          - stop_if: c
    outputs: [branch]
""")
    assert out["t"] == {"branch": "then" if truth else "else"}
    assert g["n"] == (1 if truth else 3)
