"""`instances: N`: N copies of a task's `do` at once, each in its own child workspace
(reads fall through to the task's and the node's workspaces; writes to names that exist
there update them), reading one reader safely; the analyzer warns about shared writes."""

from __future__ import annotations

import json

from runner_util import jobrun, logged

READERS = """\
job: inst
max_epochs: 1
init:
  - task: setup
    do:
      - fill: {out: ones, shape: [3000], value: 1, dtype: int64}
      - call: {fn: "torch:cumsum", in: [ones], dim: 0, out: data}
      - reader: {in: data, out: r, batch_size: 1}
      - call: {fn: "jobrun_test_helpers:new_list", out: seen}
      - call: {fn: "jobrun_test_helpers:new_list", out: counts}
epoch:
  - task: work
    instances: 4
    do:
      - const: {out: n, value: 0}
      - loop: null
        do:
          - read: {in: r, out: [x, end]}
          - stop_if: end
          - call: {fn: "jobrun_test_helpers:append", in: [seen, x]}
          - add: {in: [n, 1], out: n}
      - call: {fn: "jobrun_test_helpers:append", in: [counts, n]}
    exit:
      - call: {fn: "jobrun_test_helpers:length", in: [seen], out: total}
      - log: {in: [total, counts, seen]}
"""


def test_instances_read_one_reader_each_record_once(plan_file, tmp_path):
    r = jobrun("train", plan_file(READERS), "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    [row] = logged(tmp_path / "run")
    assert row["total"] == 3000
    assert sorted(int(x) for x in row["seen"]) == list(range(1, 3001))  # every record once
    # each instance counted its own reads in its own `n` (no lost updates, no sharing)
    assert len(row["counts"]) == 4 and sum(row["counts"]) == 3000


def test_new_names_stay_in_the_instance_and_existing_ones_are_updated(plan_file, tmp_path):
    text = """\
job: scopes
max_epochs: 1
init:
  - task: setup
    do: [{call: {fn: "jobrun_test_helpers:new_list", out: shared}}]
epoch:
  - task: work
    instances: 3
    init: [{const: {out: label, value: task}}]
    do:
      - const: {out: mine, value: 1}
      - loop: 50000
        as: i
        do: [{add: {in: [mine, 1], out: mine}}]
      - call: {fn: "jobrun_test_helpers:append", in: [shared, mine]}
      - const: {out: label, value: instance}
    exit:
      - log: {in: [shared, label]}
"""
    r = jobrun("train", plan_file(text), "--run-dir", tmp_path / "run")
    assert r.code == 0, r.text
    [row] = logged(tmp_path / "run")
    assert row["shared"] == [50001, 50001, 50001]  # each its own `mine`, never mixed
    assert row["label"] == "instance"  # `label` is the task's: the instances updated it


def test_analyze_warns_about_writes_the_instances_share(plan_file):
    text = READERS.replace("      - add: {in: [n, 1], out: n}\n",
                           "      - add: {in: [n, 1], out: n}\n      - add: {in: [data, 0], out: data}\n")
    r = jobrun("analyze", plan_file(text), "--format", "json")
    found = [d for d in json.loads(r.out)["diagnostics"] if d["code"] == "instance-race"]
    assert [(d["severity"], d["line"]) for d in found] == [("warning", 22)]
    assert "the 4 instances of task 'work' all write 'data'" in found[0]["message"]
    clean = jobrun("analyze", plan_file(READERS), "--format", "json")
    assert not [d for d in json.loads(clean.out)["diagnostics"] if d["code"] == "instance-race"]
