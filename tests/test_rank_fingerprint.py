"""Ranks whose init built different data (hosts whose data files differ, same shapes)
stop after init with a message naming the blob, the ranks and their hosts, instead of
training together on different things."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from jobrun_test_helpers import mlp_plan
from runner_util import jobrun_proc

from jobrun.runner import fingerprint

HOST_DATA = """\
import os

import torch


def load():
    # Each "host" has its own copy of the data file; rank 1's differs (same shape).
    return torch.ones(8, 4) if os.environ.get("RANK") == "1" else torch.zeros(8, 4)
"""

PLAN = mlp_plan("hosts", "seed: 0\nmax_epochs: 1\ncheckpoint: {dir: ckpt}", init=["STEP"])


def test_of_data_describes_data_and_leaves_objects_with_a_state_out():
    found = fingerprint.of_data({"t": torch.zeros(2), "a": np.ones(3), "n": 3, "s": "x", "l": [1, 2],
                                 "model": torch.nn.Linear(2, 2), "gen": torch.Generator()})
    assert sorted(found) == ["a", "l", "n", "s", "t"]


def test_rank_differences_names_the_blob_the_ranks_and_their_hosts():
    same = {"host": "a", "nodes": {"local": fingerprint.of_data({"x": torch.zeros(2, 2), "k": 3})}}
    other = {"host": "b", "nodes": {"local": fingerprint.of_data({"x": torch.ones(2, 2), "k": 3})}}
    assert fingerprint.rank_differences([same, same]) == []
    ((node, blob, line),) = fingerprint.rank_differences([same, same, other])
    assert (node, blob) == ("local", "x")
    assert line.startswith("blob 'x' of node 'local': rank 0 (host a) built float32 [2, 2] with CRC-32 ")
    assert ", rank 2 (host b) float32 [2, 2] with CRC-32 " in line
    missing = {"host": "c", "nodes": {"local": fingerprint.of_data({"k": 3})}}
    assert fingerprint.rank_differences([same, missing])[0][2].endswith("rank 1 (host c) nothing")


# Ranks whose init built the same data train on: every other 2-replica job of the tests
# does (test_distributed.py's `runs`, whose ranks each make their synthetic data).
@pytest.mark.slow
def test_replicas_whose_data_differs_stop_after_init_naming_the_hosts(tmp_path):
    (tmp_path / "host_data.py").write_text(HOST_DATA)
    (tmp_path / "plan.yaml").write_text(PLAN.replace("STEP", 'call: {fn: "host_data:load", out: table}'))
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2",
                    cwd=tmp_path, timeout=240)
    assert r.code == 1, r.text
    # said once, as the job's failure: every rank found it, none failed alone (it was
    # said by each rank, then "replica rank 0 failed ... continue with `jobrun resume`",
    # which would build the same data again)
    assert r.err.count("the ranks' init built different data") == 1, r.err
    assert "replica rank" not in r.err and "jobrun resume" not in r.err, r.err
    # at the init step that made it, with the way to give each rank its part (a TBPTT
    # port cut each rank's columns in init, as data-parallel.md said, "in a `call`")
    text = (tmp_path / "plan.yaml").read_text().splitlines()
    line = next(n for n, t in enumerate(text, 1) if "host_data:load" in t)
    assert f"plan.yaml:{line}:{text[line - 1].index('call') + 1}: error: the ranks' init" in r.err, r.err
    assert "a `call` in an epoch task cuts with its `rank` and `world_size`" in r.err
    assert f"blob 'table' of node 'local': rank 0 (host {os.uname().nodename}) built float32 [8, 4]" in r.err
    assert "rank 1 (host" in r.err and "Traceback" not in r.text
    assert not (tmp_path / "run" / "ckpt" / "local.1").exists()
