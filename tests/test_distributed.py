"""Data parallel through the CLI: replicas 1 and 2 agree, resume works, a dead rank stops the job."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from runner_util import HANG_S, ckpt_values, close, jobrun, jobrun_proc, logged, metrics

PLAN = """
job: dp
seed: 5
max_epochs: 3
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 96, features: 6, classes: 3, noise: 1.0}
      - reader: {in: [x, y], out: data, batch_size: 12, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [6, 16, 3]}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
      - const: {out: epoch_no, value: 0}
epoch:
  - task: train
    do:
      - add: {in: [epoch_no, 1], out: epoch_no}
      - call: {fn: "jobrun_test_helpers:die_on_rank", in: [epoch_no], rank: 1, at: 2}
      - loop: 8
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - log: {in: [loss]}
    outputs: [loss]
"""

pytestmark = pytest.mark.slow


def _weights(run_dir, epoch=3):
    state = ckpt_values(run_dir, epoch)["model"]["state"]
    return {k: v for k, v in state.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    plan = root / "plan.yaml"
    plan.write_text(PLAN)
    (root / "tmp").mkdir()
    env = {"JOBRUN_TEST_NO_DIE": "1", "TMPDIR": str(root / "tmp")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        one = jobrun("train", plan, "--run-dir", root / "one")  # one replica: no process of its own needed
        two = jobrun_proc("train", plan, "--run-dir", root / "two", "--replicas", "2")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert one.code == 0, one.text
    assert two.code == 0, two.text
    return root


def test_one_and_two_replicas_train_the_same_model(runs):
    w1, w2 = _weights(runs / "one"), _weights(runs / "two")
    assert w1.keys() == w2.keys()
    for key in w1:
        assert close(w1[key], w2[key], 1e-5), key
    l1 = [r["loss"] for r in logged(runs / "one")]
    l2 = [r["loss"] for r in logged(runs / "two")]
    assert all(close(a, b, 1e-4) for a, b in zip(l1, l2)) and len(l1) == len(l2) == 3
    for run in ("one", "two"):  # samples/s count the global batches: 8 of 12 an epoch
        epochs = [m for m in metrics(runs / run) if m.get("event") == "epoch"]
        assert [round(e["samples_per_s"] * e["seconds"]) for e in epochs] == [96] * 3, run


def test_a_replicas_run_leaves_nothing_in_tmpdir(runs):
    """torch's elastic agent made an empty torchelastic_* tree in $TMPDIR per run (4,208
    of them in a user's /tmp); its files go to a directory the launch removes."""
    assert list((runs / "tmp").iterdir()) == []


def test_each_rank_checkpoints_and_ranks_agree(runs):
    ck = runs / "two" / "ckpt" / "local.3"
    assert sorted(p.name for p in ck.iterdir()) == ["rank-0", "rank-1"]
    r1 = jobrun("ckpt", "show", runs / "two", "--epoch", "3", "--rank", "1", "--json")
    assert r1.code == 0, r1.text
    import json

    rank1 = json.loads(r1.out)["nodes"]["local"]["model"]["state"]
    assert rank1 == _weights(runs / "two")  # parameters identical on every rank


def test_resume_with_two_replicas_is_exact(runs, tmp_path):
    run = tmp_path / "two"
    shutil.copytree(runs / "two", run)
    os.environ["JOBRUN_TEST_NO_DIE"] = "1"
    try:
        r = jobrun_proc("resume", "--run-dir", run, "--epoch", "1")
    finally:
        os.environ.pop("JOBRUN_TEST_NO_DIE")
    assert r.code == 0, r.text
    assert _weights(run) == _weights(runs / "two")


def test_resume_with_other_replica_count_says_so(runs, tmp_path):
    run = tmp_path / "two"
    shutil.copytree(runs / "two", run)
    import json

    info = json.loads((run / "run.json").read_text())
    info["replicas"] = 1
    (run / "run.json").write_text(json.dumps(info))
    r = jobrun("resume", "--run-dir", run, "--epoch", "1")  # refused before any process starts
    assert r.code == 1
    assert "written by 2 replicas" in r.text and "Traceback" not in r.text


def test_dead_rank_stops_the_job_and_it_resumes(runs, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "run"
    r = jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", timeout=HANG_S)  # a hang fails
    assert r.code == 1, r.text
    assert "replica rank 1 failed" in r.err and "killed by signal 9" in r.err
    assert "jobrun resume" in r.err
    # torch's own lines (the agent's traceback of the dead worker) go to the run's log
    assert "Traceback" not in r.text and "torch.distributed" not in r.text
    log = (run / "console.log").read_text()
    assert "ProcessExitedException" in log and "local_rank: 1" in log
    os.environ["JOBRUN_TEST_NO_DIE"] = "1"
    try:
        again = jobrun_proc("resume", "--run-dir", run)
    finally:
        os.environ.pop("JOBRUN_TEST_NO_DIE")
    assert again.code == 0, again.text
    assert "resumed from checkpoint epoch 1" in again.out
    assert _weights(run) == _weights(runs / "two")


def test_a_rank_killed_while_the_other_waits_in_a_collective_is_named_at_once_and_alone(tmp_path):
    # A user's run (a 76 MB MLP, rank 1 killed with kill -9 in the middle of its steps)
    # saw rank 0 get the broken connection, wait 15 s in the store (for a message, then
    # for the launcher's signal, which the store's wait held off) and print torch's
    # "Connection reset by peer" with a frame of jobrun's as its own error; the launcher
    # named rank 1 only then. This smaller run did not show it before the fix (timing);
    # it checks that the death is said by the launcher alone.
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("die_on_rank", "die_later"))
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / "run", "--replicas", "2", timeout=HANG_S)
    assert r.code == 1, r.text
    assert "replica rank 1 failed (exit code -9): killed by signal 9" in r.err, r.err
    assert "[rank 0]" not in r.err and "c10d" not in r.err and "reset by peer" not in r.err, r.err
    assert "jobrun/" not in r.err and "Traceback" not in r.text


def test_under_torchrun_jobrun_uses_the_given_environment(runs, tmp_path):
    import subprocess
    import sys

    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run = tmp_path / "run"
    env = {**os.environ, "JOBRUN_TEST_NO_DIE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "jobrun", "train", str(plan), "--run-dir", str(run)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(x.name for x in (run / "ckpt" / "local.3").iterdir()) == ["rank-0", "rank-1"]
    assert _weights(run) == _weights(runs / "two")
    # Resume under torchrun with rank 1's last save damaged (only its checksum can tell):
    # each process checks its own rank, and both skip epoch 3 together.
    data = run / "ckpt" / "local.3" / "rank-1" / "tensors.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "status": "running"}))
    cmd = [*cmd[:cmd.index("train")], "resume", "--run-dir", str(run)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr.count("warning: skipping checkpoint epoch 3:") == 1
    assert "rank-1/tensors.safetensors: checksum mismatch" in p.stderr
    assert "resumed from checkpoint epoch 2" in p.stdout
    assert _weights(run) == _weights(runs / "two")


THREADS_PLAN = """
job: threads
max_epochs: 1
init:
  - task: setup
    do:
      - call: {fn: "jobrun_test_helpers:record_threads", path: "OUT"}
epoch:
  - task: noop
    do:
      - const: {out: x, value: 1}
"""


# JOBRUN_THREADS has no launch of its own: it reaches the ranks as OMP_NUM_THREADS does
# (the launch below), and what a rank does with it is the test after.
@pytest.mark.parametrize("env, expect", [
    ({}, lambda cpus: max(1, cpus // 2)),  # each rank its share of the CPUs
    ({"OMP_NUM_THREADS": "2"}, lambda cpus: 2),  # the user's OMP_NUM_THREADS is kept
])
def test_ranks_on_one_host_share_its_cpus(tmp_path, monkeypatch, env, expect):
    plan = tmp_path / "plan.yaml"
    plan.write_text(THREADS_PLAN.replace("OUT", str(tmp_path / "threads")))
    for name in ("JOBRUN_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = jobrun_proc("train", plan, "--run-dir", tmp_path / "run", "--replicas", "2")
    assert r.code == 0, r.text
    want = expect(len(os.sched_getaffinity(0)))
    assert [int((tmp_path / f"threads.{rank}").read_text()) for rank in (0, 1)] == [want, want]


@pytest.mark.parametrize("omp", [None, "3"])
def test_jobrun_threads_pins_a_ranks_thread_count(monkeypatch, omp):
    import torch

    from jobrun.runner.workers import _set_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as the launcher sets it for 2 ranks
    monkeypatch.setenv("JOBRUN_THREADS", "2")
    if omp:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)  # JOBRUN_THREADS wins over it
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 3)
        _set_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
