"""Steps that talk to the other replicas at the same time are refused with replicas.

Found writing plans from the docs: two `evaluate`s in a `parallel` gave each other's
numbers on 2 replicas (val_loss 0.2330 one run, 0.2049 the next), and two nodes whose init
tasks each build a model aborted in gloo ("Is there a distributed collective mismatch").
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from runner_util import jobrun

from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_text

SETUP = """\
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 32, features: 4, classes: 2}
      - reader: {in: [x, y], out: val, batch_size: 8}
      - model.mlp: {out: model, sizes: [4, 2]}
"""
PARALLEL = """\
epoch:
  - task: t
    do:
      - parallel:
          - do: [{evaluate: {in: [model, val], out: [a_loss, a_acc]}}]
          - do: [{evaluate: {in: [model, val], out: [b_loss, b_acc]}}]
      - log: {in: [a_loss, b_loss]}
"""


def _found(top: str, body: str) -> list[tuple[str, int, str]]:
    plan = compile_text(f"job: j\nmax_epochs: 1\n{top}{SETUP}{textwrap.dedent(body)}", "p.yaml")
    return [(d.severity, d.pos.line, d.message) for d in analyze(plan) if d.code == "concurrent-collectives"]


def test_parallel_evaluates_are_an_error_with_replicas_only() -> None:
    [(severity, line, message)] = _found("replicas: 2\n", PARALLEL)
    assert (severity, line) == ("error", 15)  # the second branch's evaluate
    assert "parallel` at line 13" in message and "(line 14)" in message
    assert _found("", PARALLEL) == []  # one replica: the threads talk to nobody
    assert [s for s, _, _ in _found("replicas: auto\n", PARALLEL)] == ["warning"]


@pytest.mark.parametrize("body, line, words", [
    ("""\
     epoch:
       - task: t
         do:
           - report: 1s
             do: [{evaluate: {in: [model, val], out: [l, a]}}]
           - const: {out: z, value: 0}
     """, 14, "from a report"),
    ("""\
     epoch:
       - task: t
         instances: 2
         do: [{evaluate: {in: [model, val], out: [l, a]}}]
     """, 13, "2 instances of task 't'"),
    ("""\
     epoch:
       - task: a
         do: [{evaluate: {in: [model, val], out: [l, a]}}]
       - task: b
         do: [{dist.allreduce: {in: l0, out: l1}}]
     """, 15, "in task 'b'"),
])
def test_reports_instances_and_tasks_of_a_group(body: str, line: int, words: str) -> None:
    body = textwrap.dedent(body).replace("do: [{dist", "init: [{const: {out: l0, value: 1.0}}]\n    do: [{dist")
    [(severity, at, message)] = _found("replicas: 2\n", body)
    assert (severity, at) == ("error", line) and words in message


def test_one_task_in_order_is_fine() -> None:
    assert _found("replicas: 2\n", """\
        epoch:
          - task: t
            do:
              - evaluate: {in: [model, val], out: [a_loss, a_acc]}
              - parallel:
                  - do: [{evaluate: {in: [model, val], out: [b_loss, b_acc]}}]
                  - do: [{const: {out: c, value: 1}}]
              - report: 1s
                do: [{log: {in: [a_loss]}}]
              - log: {in: [b_loss, c]}
        """) == []


def test_train_and_resume_with_replicas_refuse_it_before_the_run(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"job: j\nmax_epochs: 2\ncheckpoint: {{}}\n{SETUP}{PARALLEL}")
    run = tmp_path / "run"
    r = jobrun("train", str(plan), "--replicas", "2", "--run-dir", str(run))
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert f"{plan}:15:19: error: with 2 replicas, `evaluate`" in r.err
    assert not run.exists()
    assert jobrun("train", str(plan), "--run-dir", str(run), "max_epochs=1").code == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    r = jobrun("resume", str(run), "--replicas", "2", "max_epochs=2")
    assert r.code == 2 and ":15:19: error: with 2 replicas" in r.err, r.err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
