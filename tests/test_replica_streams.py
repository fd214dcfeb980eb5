"""Every replica runs init on the same streams (same models), then draws its own: dropout
and other draws in the epochs differ between replicas, replica 0 draws what one process
draws, and a resume continues each replica's streams (docs/data-parallel.md)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from runner_util import jobrun, jobrun_proc

import jobrun as jobrun_pkg

PLAN = """
job: streams
seed: 5
max_epochs: {epochs}
checkpoint: {{dir: ckpt}}
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: classification, n: 16, features: 4, classes: 2}}
      - model.mlp: {{out: model, sizes: [4, 8, 2], dropout: 0.5}}
      - optimizer: {{in: model, out: opt, lr: 0.1}}
      - reader: {{in: [x, y], out: data, batch_size: 8, shuffle: true}}
      - const: {{out: epoch_no, value: 0}}
epoch:
  - task: train
    do:
      - add: {{in: [epoch_no, 1], out: epoch_no}}
      - call: {{fn: "jobrun_test_helpers:record_draws", in: [epoch_no], path: "{draws}"}}
      - loop: null
        do:
          - read: {{in: data, out: [xb, yb, end]}}
          - stop_if: end
          - train.step: {{in: [model, opt, xb, yb], out: loss}}
"""


def _draws(path) -> dict[tuple[int, int, int], dict]:
    out = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out[d["world"], d["rank"], d["epoch"]] = d  # a resume's line replaces the killed run's
    return out


def _run(tmp_path, name: str, replicas: str, epochs: int = 3):
    draws = tmp_path / f"{name}.jsonl"
    plan = tmp_path / f"{name}.yaml"
    plan.write_text(PLAN.format(epochs=epochs, draws=draws))
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / name, "--replicas", replicas)
    assert r.code == 0, r.text
    return draws


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process for 3 epochs and two replicas for 4, shared by the tests (each run
    starts torch on every rank: seconds of CPU)."""
    tmp = tmp_path_factory.mktemp("streams")
    return tmp, _run(tmp, "one", "1", epochs=3), _run(tmp, "two", "2", epochs=4)


@pytest.mark.slow
def test_replicas_draw_their_own_streams_and_replica_0_draws_one_process_s(runs):
    _, one_path, two_path = runs
    one, two = _draws(one_path), _draws(two_path)
    for epoch in (1, 2, 3):
        r0, r1 = two[2, 0, epoch], two[2, 1, epoch]
        for stream in ("torch", "numpy", "python"):
            # the dropout of a replica's slice draws less than one process's whole batch
            if stream != "torch" or epoch == 1:
                assert r0[stream] == one[1, 0, epoch][stream], (stream, epoch)
            assert r1[stream] != r0[stream], (stream, epoch)
    # what the docs tell a hand loop to do on replica 1, once its models are built
    seed = jobrun_pkg.replica_seed(5, 1)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    assert two[2, 1, 1]["torch"] == torch.rand(3).tolist()
    assert two[2, 1, 1]["numpy"] == np.random.rand(2).tolist()
    assert two[2, 1, 1]["python"] == random.random()


@pytest.mark.slow
def test_a_resume_continues_each_replicas_streams_and_a_new_replica_gets_its_own(runs):
    tmp, one_path, two_path = runs
    whole = _draws(two_path)
    part = _run(tmp, "part", "2", epochs=2)
    r = jobrun("resume", "--run-dir", tmp / "part", "max_epochs=4")
    assert r.code == 0, r.text
    resumed = _draws(part)
    for epoch in (3, 4):
        for rank in (0, 1):
            assert resumed[2, rank, epoch]["torch"] == whole[2, rank, epoch]["torch"]
    # one process resumed onto two: replica 1 has no streams of its own to restore (the
    # run's one-process lines, world 1, stay as they were)
    r = jobrun_proc("resume", "--run-dir", tmp / "one", "--replicas", "2", "max_epochs=4")
    assert r.code == 0, r.text
    grown = _draws(one_path)
    assert grown[2, 1, 4]["torch"] != grown[2, 0, 4]["torch"]
    assert (2, 0, 3) not in grown  # it went on from epoch 3
