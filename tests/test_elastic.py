"""Replicas that die, stop and change in number: automatic restarts, Ctrl-C with replicas,
resume with another number of replicas (real processes through torch's elastic launcher)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_util import HANG_S, ckpt_values, close, jobrun, jobrun_proc, logged, metrics

pytestmark = pytest.mark.slow

# A 2-replica job of 4 epochs of 8 steps; a step takes at least 30 ms (the sleep), so that
# a signal or a death lands in the middle of an epoch. `die_once` kills rank 1 at step 4
# of epoch 3 (once, or `times` times: its file counts the deaths).
PLAN = """
job: elastic
seed: 5
max_epochs: 4
vars: {times: 1, deaths: ""}
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
      - loop: 8
        as: i
        do:
          - read: {in: data, out: [xb, yb, end]}
          - if: end
            then: [{read: {in: data, out: [xb, yb, end]}}]
          - call: {fn: "jobrun_test_helpers:die_once", in: [epoch_no, i], path: "${deaths}", times: "${times}"}
          - call: {fn: "jobrun_test_helpers:sleep", in: [0.03]}
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - log: {in: [loss]}
    outputs: [loss]
"""


def _weights(run_dir: Path, epoch: int = 4) -> dict:
    return ckpt_values(run_dir, epoch)["model"]["state"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The 2-replica job, never interrupted."""
    root = tmp_path_factory.mktemp("elastic")
    plan = root / "plan.yaml"
    plan.write_text(PLAN)
    r = jobrun_proc("train", plan, "--run-dir", root / "run", "--replicas", "2", timeout=HANG_S)
    assert r.code == 0, r.text
    return root / "run"


# -- automatic restarts ---------------------------------------------------------------------------


def test_a_killed_rank_is_restarted_and_the_job_ends_as_if_never_killed(reference, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run, deaths = tmp_path / "run", tmp_path / "deaths"
    r = jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", "--max-restarts", "1",
                    f"vars.deaths={deaths}", timeout=HANG_S)
    assert r.code == 0, r.text
    assert len(deaths.read_text().splitlines()) == 1  # it did die, once
    assert "rank 1 died (killed by SIGKILL); restarting every rank" in r.out
    assert "restart 1: rank 1 died (killed by SIGKILL); resumed from checkpoint epoch 2" in r.out
    assert "Traceback" not in r.text and "error" not in r.err
    assert _weights(run) == _weights(reference)
    events = [m for m in metrics(run) if m.get("event") == "restart"]
    assert events == [{"epoch": 2, "event": "restart", "restart": 1, "rank": 1, "exitcode": -9,
                       "signal": "SIGKILL", "from_epoch": 2, "time": events[0]["time"]}]
    # metrics.jsonl reads as an uninterrupted run's (plus the restart): one line an epoch
    assert [x["_epoch"] for x in logged(run)] == [1, 2, 3, 4]
    assert [x["loss"] for x in logged(run)] == [x["loss"] for x in logged(reference)]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["max_restarts"] == 1
    assert [(x["restart"], x["rank"], x["signal"], x["from_epoch"]) for x in info["restarts"]] == \
        [(1, 1, "SIGKILL", 2)]


def test_a_rank_restarted_during_a_resume_keeps_the_resumes_record_as_written_once(reference, tmp_path):
    # The resume records itself once its checkpoint is restored (runner/resuming.py); the
    # restarted ranks resume from a later checkpoint and must not record it again (it
    # would drop the metrics after the resume's own epoch, and add its overrides twice).
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    run, deaths = tmp_path / "run", tmp_path / "deaths"
    assert jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", "max_epochs=2",
                       timeout=HANG_S).code == 0
    r = jobrun_proc("resume", run, "--epoch", "1", "--max-restarts", "1", "max_epochs=4",
                    f"vars.deaths={deaths}", timeout=HANG_S)
    assert r.code == 0, r.text
    assert "restart 1: rank 1 died (killed by SIGKILL); resumed from checkpoint epoch 2" in r.out
    assert _weights(run) == _weights(reference)
    assert [x["_epoch"] for x in logged(run)] == [1, 2, 3, 4]
    assert [x["loss"] for x in logged(run)] == [x["loss"] for x in logged(reference)]
    info = json.loads((run / "run.json").read_text())
    assert info["sets"] == ["max_epochs=2", "max_epochs=4", f"vars.deaths={deaths}"]
    assert [c["from_epoch"] for c in info["changes"]] == [1] and info["resumed_from"] == 1
    # the checkpoint names the model's own class, not the DDP<Class> replicate() gives it
    shown = jobrun("ckpt", "show", run, "--blob", "model")
    assert "model = state of torch.nn.modules.container.Sequential" in shown.out, shown.text


def test_a_rank_that_dies_more_often_than_allowed_stops_the_job_cleanly(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("max_epochs: 4", "max_epochs: 3\nmax_restarts: 1"))
    run, deaths = tmp_path / "run", tmp_path / "deaths"
    r = jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", f"vars.deaths={deaths}",
                    "vars.times=5", timeout=HANG_S)
    assert r.code == 1, r.text
    assert len(deaths.read_text().splitlines()) == 2, r.text  # the first try and the one restart
    assert r.out.count("restarting every rank") == 1
    assert "replica rank 1 failed (exit code -9): killed by signal 9" in r.err
    assert "(after 1 restart)" in r.err and f"jobrun resume {run}" in r.err
    assert "Traceback" not in r.text and "torch.distributed" not in r.text
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and len(info["restarts"]) == 1


# -- a rank whose save fails ------------------------------------------------------------------------


def test_a_save_that_fails_on_another_rank_is_reported_by_rank_0(reference, tmp_path):
    # Rank 1's save of epoch 2 fails (a full disk): it says so on stderr, rank 0's console
    # and metrics say that epoch 2 is not whole, and resume goes on from a whole one.
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("      - const: {out: epoch_no, value: 0}\n",
                                 "      - const: {out: epoch_no, value: 0}\n"
                                 '      - call: {fn: "jobrun_test_helpers:fail_saves_on_rank"}\n'))
    run = tmp_path / "run"
    r = jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", timeout=HANG_S)
    assert r.code == 0, r.text
    assert "[rank 1] warning: checkpoint of epoch 2 was NOT saved: " in r.err
    assert "No space left on device" in r.err
    said = ("checkpoint of epoch 2 was NOT saved by 1 of 2 ranks (each says why on stderr); a resume "
            "goes on from the newest epoch that every rank saved")
    assert said in r.err and said in (run / "console.log").read_text()
    assert [m["message"] for m in metrics(run) if m.get("event") == "warning"] == [said]
    listed = jobrun("ckpt", "list", run).out
    assert "rank 1 of 2 missing" in next(ln for ln in listed.splitlines() if ln.split()[0] == "2")
    assert _weights(run) == _weights(reference)  # the other epochs were saved as ever
    again = jobrun_proc("resume", "--run-dir", run, "--epoch", "2", timeout=HANG_S)
    assert again.code != 0 and "epoch 2" in again.err


def test_saves_that_fail_on_every_rank_are_counted_as_every_rank(tmp_path):
    # Both ranks' saves of epoch 2 fail: rank 0's summary counts itself too, not 1 of 2.
    fail = '      - call: {{fn: "jobrun_test_helpers:fail_saves_on_rank", rank: {}}}\n'
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("      - const: {out: epoch_no, value: 0}\n",
                                 "      - const: {out: epoch_no, value: 0}\n" + fail.format(0) + fail.format(1)))
    run = tmp_path / "run"
    r = jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", timeout=HANG_S)
    assert r.code == 0, r.text
    assert "[rank 1] warning: checkpoint of epoch 2 was NOT saved: " in r.err
    said = "checkpoint of epoch 2 was NOT saved by 2 of 2 ranks (each says why on stderr)"
    assert said in r.err and said in (run / "console.log").read_text(), r.err


@pytest.mark.parametrize("background", ["false", "true"])
def test_a_last_save_that_fails_on_another_rank_fails_the_run_on_every_rank(reference, tmp_path, background):
    # Rank 1's save of epoch 4, the last, fails (a full disk): no rank runs on as if the
    # run had finished; the launcher exits 1 with one message, and once the disk has
    # space, a resume finishes the run as if it had never failed.
    full = tmp_path / "full"
    full.touch()
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.replace("checkpoint: {dir: ckpt}", f"checkpoint: {{dir: ckpt, async: {background}}}")
                    .replace("      - const: {out: epoch_no, value: 0}\n",
                             "      - const: {out: epoch_no, value: 0}\n"
                             f'      - call: {{fn: "jobrun_test_helpers:fail_saves_on_rank", at: 4, full: "{full}"}}\n'))
    run = tmp_path / "run"
    r = jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", timeout=HANG_S)
    assert r.code == 1 and "Traceback" not in r.text, r.text
    said = ("error: the checkpoint of epoch 4, the last, was NOT saved by rank 1 of 2: [Errno 28] No space left "
            "on device; the run has not finished (its newest checkpoint is epoch 3)")
    assert r.err.count("error:") == 1 and said in r.err, r.err  # no "replica rank N failed"
    assert f"`jobrun resume {run}` trains again from there" in r.err
    assert said in (run / "console.log").read_text()
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and info["error"] == said.removeprefix("error: ")
    full.unlink()  # space was freed
    again = jobrun_proc("resume", run, timeout=HANG_S)
    assert again.code == 0 and "resumed from checkpoint epoch 3" in again.out, again.text
    assert _weights(run) == _weights(reference)
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


def test_ranks_that_failed_to_save_different_epochs_name_the_newest_epoch_both_saved(tmp_path):
    # Rank 0's save of epoch 3 fails, rank 1's of epoch 4 (the last): the error named
    # epoch 3 (rank 1's newest) as the one a resume goes on from; rank 0 lacks it.
    fail = '      - call: {{fn: "jobrun_test_helpers:fail_saves_on_rank", rank: {}, at: {}}}\n'
    plan = tmp_path / "plan.yaml"
    plan.write_text("job: saves\nmax_epochs: 4\ncheckpoint: {dir: ckpt}\ninit:\n  - task: setup\n    do:\n"
                    "      - const: {out: n, value: 0}\n" + fail.format(0, 3) + fail.format(1, 4) +
                    "epoch:\n  - task: count\n    do: [{add: {in: [n, 1], out: n}}]\n")
    run = tmp_path / "run"
    r = jobrun_proc("train", plan, "--run-dir", run, "--replicas", "2", timeout=HANG_S)
    assert r.code == 1 and "Traceback" not in r.text, r.text
    said = ("error: the checkpoint of epoch 4, the last, was NOT saved by rank 1 of 2: [Errno 28] No space left "
            "on device; the run has not finished (its newest checkpoint is epoch 2)")
    assert said in r.err, r.err


# -- Ctrl-C with replicas --------------------------------------------------------------------------


def _start(plan: Path, run: Path) -> subprocess.Popen:
    # A session of its own: the test can signal its whole process group, as a terminal does.
    return subprocess.Popen([sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run),
                             "--replicas", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _in_epoch_2(tmp_path: Path, text: str) -> tuple[subprocess.Popen, Path]:
    """The 2-replica job of ``text`` started (_start), once both ranks saved epoch 1."""
    plan, run = tmp_path / "plan.yaml", tmp_path / "run"
    plan.write_text(text)
    p = _start(plan, run)
    deadline = time.monotonic() + HANG_S
    while not (run / "ckpt" / "local.1" / "rank-1" / "COMMIT").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.02)
    return p, run


# SIGTERM to the launcher has no case of its own: SIGUSR1's case goes through it (the
# launcher turns SIGUSR1 into a SIGTERM to itself). Only ddp's SIGINT case resumes: a
# stopped run resumes from its last epoch checkpoint, and that fsdp's resume from one is
# exact is test_fsdp.py's test_fsdp_resume_is_exact (and its killed-rank test).
@pytest.mark.parametrize("to,sig,parallel", [
    ("launcher", signal.SIGINT, "ddp"), ("group", signal.SIGINT, "ddp"),
    ("launcher", signal.SIGUSR1, "ddp"), ("launcher", signal.SIGINT, "fsdp"),
    # SLURM signals the group: Python's resource tracker, in the launcher's group, died
    # of SIGUSR1 and printed a traceback for each semaphore of the workers
    ("group", signal.SIGUSR1, "ddp")])
def test_a_signal_stops_every_replica_at_once_and_the_run_resumes_exactly(reference, tmp_path, to, sig, parallel):
    # fsdp agrees on the stop flags as ddp does (an asynchronous all-reduce read a step later)
    p, run = _in_epoch_2(tmp_path, PLAN if parallel == "ddp" else "parallel: fsdp" + PLAN)
    time.sleep(0.1)  # in the middle of epoch 2
    os.killpg(p.pid, sig) if to == "group" else p.send_signal(sig)
    out, err = p.communicate(timeout=HANG_S)
    # SIGUSR1 (SLURM's warning) reaches the ranks as the SIGTERM torch's agent forwards.
    stopped = signal.SIGTERM if sig == signal.SIGUSR1 else sig
    assert p.returncode == 128 + stopped, (out, err)
    log = (run / "console.log").read_text()
    # torch's agent SIGKILLs workers that take over 5 s to stop: they stopped in time
    assert "forcefully" not in log and "SIGKILL" not in log + out + err
    assert f"stopped by {stopped.name}" in err and "Traceback" not in out + err
    assert "resource_tracker" not in out + err, err
    # Both ranks stopped at the same point: the same checkpoints, none half written.
    saved = sorted(p.name for p in (run / "ckpt").iterdir())
    assert all(sorted(x.name for x in (run / "ckpt" / e).iterdir()) == ["rank-0", "rank-1"] for e in saved)
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    if to == "launcher" and sig == signal.SIGINT and parallel == "ddp":
        again = jobrun_proc("resume", "--run-dir", run, timeout=HANG_S)
        assert again.code == 0, again.text
        assert _weights(run) == _weights(reference)


def test_a_launcher_killed_stops_its_ranks_which_say_why(reference, tmp_path):
    # torch's workers get SIGINT when their launcher dies: they said "stopped by SIGINT",
    # and run.json too, though nobody pressed Ctrl-C.
    p, run = _in_epoch_2(tmp_path, PLAN)
    p.kill()
    out, err = p.communicate(timeout=HANG_S)  # the ranks hold its pipes until they end
    assert "stopped: the launcher went away (killed?)" in err and "SIGINT" not in err, err
    assert "Traceback" not in out + err and "leaked semaphore" not in err
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted" and "launcher went away" in info["error"]
    again = jobrun_proc("resume", "--run-dir", run, timeout=HANG_S)
    assert again.code == 0, again.text
    assert _weights(run) == _weights(reference)


# -- resume with another number of replicas ----------------------------------------------------------

# The MLP example's job with ids beside the data: `record_ids` logs which records each rank
# reads at each step. 240 records in global batches of 32 (a pass is 8 steps, the last
# one 16 records) and 5 steps an epoch, so passes straddle epochs.
MLP = """
job: mlp-ids
seed: 0
max_epochs: 4
vars: {ids: ids.jsonl}
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: classification, n: 240, features: 16, classes: 4, noise: 1.5}
      - call: {fn: "torch:arange", in: [240], out: ids}
      - reader: {in: [x, y, ids], out: train_data, batch_size: 32, shuffle: true, passes: 0}
      - model.mlp: {out: model, sizes: [16, 32, 32, 4]}
      - optimizer: {in: model, out: opt, lr: 0.1, momentum: 0.9}
      - const: {out: epoch_no, value: 0}
epoch:
  - task: train
    do:
      - add: {in: [epoch_no, 1], out: epoch_no}
      - loop: 5
        do:
          - read: {in: train_data, out: [xb, yb, ib, end]}
          - if: end
            then: [{read: {in: train_data, out: [xb, yb, ib, end]}}]
          - call: {fn: "jobrun_test_helpers:record_ids", in: [ib, epoch_no], path: "${ids}"}
          - train.step: {in: [model, opt, xb, yb], out: loss}
      - log: {in: [loss]}
    outputs: [loss]
"""


def _global_batches(path: Path) -> list[list[int]]:
    """The records of each global batch, in order: step k of an epoch is every rank's k-th
    line of that epoch (ranks read slices of one global batch)."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    batches = []
    for epoch in sorted({x["epoch"] for x in lines}):
        ranks = {}
        for x in lines:
            if x["epoch"] == epoch:
                ranks.setdefault(x["rank"], []).append(x["ids"])
        steps = {len(v) for v in ranks.values()}
        assert len(steps) == 1, ranks
        batches += [sum((ranks[r][k] for r in sorted(ranks)), []) for k in range(steps.pop())]
    return batches


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory) -> Path:
    """The job never interrupted (1 replica), and its first 2 epochs with 1 and 2 replicas."""
    root = tmp_path_factory.mktemp("mlp")
    plan = root / "plan.yaml"
    plan.write_text(MLP)
    for name, replicas, epochs in (("whole", 1, 4), ("one", 1, 2), ("two", 2, 2)):
        r = jobrun_proc("train", plan, "--run-dir", root / name, "--replicas", str(replicas),
                        f"max_epochs={epochs}", f"vars.ids={root / name}.ids", timeout=HANG_S)
        assert r.code == 0, r.text
    return root


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_with_another_number_of_replicas(mlp_runs, tmp_path, before, after):
    name = {1: "one", 2: "two"}[before]
    run, ids = tmp_path / name, tmp_path / f"{name}.ids"
    shutil.copytree(mlp_runs / name, run)
    shutil.copy(mlp_runs / f"{name}.ids", ids)
    r = jobrun_proc("resume", "--run-dir", run, "--replicas", str(after), "max_epochs=4",
                    f"vars.ids={ids}", timeout=HANG_S)
    assert r.code == 0, r.text
    assert f"resuming with {after} replica" in r.err and "resumed from checkpoint epoch 2" in r.out
    # The global position in the pass is kept: the same global batches as the run never
    # interrupted, each pass a permutation of all 240 records (every sample once).
    batches = _global_batches(ids)
    assert [sorted(b) for b in batches] == [sorted(b) for b in _global_batches(mlp_runs / "whole.ids")]
    flat = [i for b in batches for i in b]
    assert sorted(flat[:240]) == sorted(flat[240:480]) == list(range(240))
    assert len(set(flat[480:])) == len(flat[480:]) == 4 * 32
    # ... and each rank read its share of every global batch after the change.
    lines = [json.loads(x) for x in ids.read_text().splitlines()]
    assert {x["world"] for x in lines if x["epoch"] > 2} == {after}
    # The loss goes on as the uninterrupted run's, up to float rounding of the sums.
    assert close([x["loss"] for x in logged(run)], [x["loss"] for x in logged(mlp_runs / "whole")], 1e-4)
    assert close(list(_weights(run).values()), list(_weights(mlp_runs / "whole").values()), 1e-5)
    info = json.loads((run / "run.json").read_text())
    assert info["replicas"] == after
    assert info["replica_changes"] == [{"from_epoch": 2, "from": before, "to": after}]


def test_resume_without_replicas_says_how_many_the_checkpoint_needs(mlp_runs, tmp_path):
    run = tmp_path / "two"
    shutil.copytree(mlp_runs / "two", run)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "replicas": 1, "status": "running"}))
    for args in ((), ("--epoch", "1")):
        r = jobrun("resume", "--run-dir", run, *args)
        assert r.code == 1, r.text
        assert "was written by 2 replicas; this run has 1" in r.err
        assert "resume with 2 replicas (--replicas 2)" in r.err
        assert "train again" not in r.text and "Traceback" not in r.text


# -- several hosts without a shared filesystem --------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosts(command: list[str], dirs: list[Path], plans: list[str], extra: list[str],
           attempt: int = 0) -> list[subprocess.CompletedProcess]:
    """`command` on two "hosts": two torchrun launches of one rank each, each in its own
    directory (its cwd and run directory), meeting at one master port.

    A host whose launch ends while the other still waits is not waited for forever (the
    other waited for it at the rendezvous for torchrun's 10 minutes, once in a full run
    under xdist): after LONE_S the other is stopped, and their outputs are returned. Such
    a launch (at the rendezvous: the port taken meanwhile by another test's, we think) is
    tried once more on a new port."""
    port = str(_free_port())
    procs, outs = [], []
    for node, (cwd, plan) in enumerate(zip(dirs, plans)):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                "-m", "jobrun", *command, *([plan] if plan else []), "--run-dir", "run", *extra]
        out = [(cwd.parent / f".{cwd.name}-{attempt}.{k}").open("w+") for k in ("out", "err")]
        outs.append(out)
        procs.append(subprocess.Popen(argv, cwd=cwd, stdout=out[0], stderr=out[1], text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    deadline, lone = time.monotonic() + HANG_S, None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if lone is None and any(p.poll() not in (None, 0) for p in procs):
            lone = time.monotonic()  # one ended in failure: the other may wait for it forever
        if lone is not None and time.monotonic() - lone > LONE_S:
            break
        time.sleep(0.2)
    stopped = False
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            stopped = lone is not None
    done = []
    for p, (out, err) in zip(procs, outs):
        out.seek(0)
        err.seek(0)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    # One host ended while the other still waited for it: at the rendezvous (a rank that
    # failed in a collective ends its peers' collectives too, so they end by themselves).
    if stopped and attempt == 0:
        return _hosts(command, dirs, plans, extra, attempt + 1)
    return done


LONE_S = 60


def test_two_hosts_without_a_shared_disk_train_die_and_resume(reference, tmp_path):
    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    host0.mkdir()
    host1.mkdir()
    (host0 / "plan.yaml").write_text(PLAN)
    deaths = tmp_path / "deaths"
    # Host 1 has no plan file: rank 0's plan is used. Rank 1 is killed in epoch 3.
    first = _hosts(["train"], [host0, host1], ["plan.yaml", "missing.yaml"],
                   [f"vars.deaths={deaths}", "checkpoint.keep=2", "checkpoint.upload=shipped"])
    assert [p.returncode != 0 for p in first] == [True, True], [p.stdout + p.stderr for p in first]
    assert deaths.read_text().count("\n") == 1
    # Each host holds its own rank's checkpoints and a copy of the plan; `keep` prunes
    # both hosts, though neither holds a complete epoch (epochs 0-2 were saved).
    for host in (host0, host1):
        assert sorted(p.name for p in (host / "run" / "ckpt").iterdir()) == ["local.1", "local.2"]
    assert {p.name for p in (host0 / "run" / "ckpt" / "local.2").iterdir()} == {"rank-0"}
    assert {p.name for p in (host1 / "run" / "ckpt" / "local.2").iterdir()} == {"rank-1"}
    assert (host1 / "run" / "plan.yaml").read_text() == (host0 / "run" / "plan.yaml").read_text()
    assert not (host1 / "run" / "metrics.jsonl").exists()  # rank 0 keeps the run's records
    again = _hosts(["resume"], [host0, host1], [None, None], [])
    assert [p.returncode for p in again] == [0, 0], [p.stdout + p.stderr for p in again]
    assert "resumed from checkpoint epoch 2" in again[0].stdout
    # Rank 0's directory lacks rank 1's files: the upload says so (no "can be deleted").
    said = again[0].stdout + again[0].stderr
    assert "upload of node 'local' skipped" in said and "holds rank 0 of 2 of epoch 4" in said, said
    assert "deleted" not in said and not (host0 / "run" / "shipped").exists()
    for host, other in ((host0, 1), (host1, 0)):
        assert sorted(p.name for p in (host / "run" / "ckpt").iterdir()) == ["local.3", "local.4"]
        # `ckpt list` on one host: its own ranks intact, the others elsewhere.
        listed = jobrun("ckpt", "list", host / "run")
        assert listed.code == 0, listed.text
        assert listed.out.count(f"ok here (rank {other} of 2 on other hosts)") == 2, listed.out
        assert "INVALID" not in listed.out
    assert _weights(host0 / "run") == _weights(reference)
    # On rank 0's host, export takes the latest epoch whose ranks here are intact: under
    # DDP rank 0's files hold the whole model ("no complete checkpoint" before)
    exported = jobrun("export", host0 / "run", "--blob", "model", "-o", tmp_path / "model.json")
    assert exported.code == 0 and (tmp_path / "model.json").is_file(), exported.text
    rank1 = jobrun("ckpt", "show", host1 / "run", "--epoch", "4", "--rank", "1", "--json")
    assert rank1.code == 0, rank1.text
    assert json.loads(rank1.out)["nodes"]["local"]["model"]["state"] == _weights(reference)
    verified = jobrun("ckpt", "list", host0 / "run", "--verify")  # checksums of the ranks here
    assert verified.out.count("ok here (rank 1 of 2 on other hosts)") == 2, verified.text
    (host1 / "run" / "ckpt" / "local.4" / "rank-1" / "COMMIT").unlink()  # a rank here is damaged
    listed = jobrun("ckpt", "list", host1 / "run").out.splitlines()
    assert "ok here" in listed[1] and listed[1].split()[0] == "3"
    assert "INVALID" in listed[2] and "COMMIT" in listed[2] and listed[2].split()[0] == "4"


def test_two_hosts_without_a_shared_disk_resume_from_the_best_epoch(tmp_path):
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        host.mkdir()
    (hosts[0] / "plan.yaml").write_text(PLAN)
    first = _hosts(["train"], hosts, ["plan.yaml", "missing.yaml"],
                   ["max_epochs=3", "checkpoint.best={monitor: loss, mode: max}"])
    assert [p.returncode for p in first] == [0, 0], [p.stdout + p.stderr for p in first]
    # Rank 0's directory holds only its own rank's files, and still knows the best epoch.
    listed = jobrun("ckpt", "list", hosts[0] / "run")
    best = [line.split()[0] for line in listed.out.splitlines() if "best loss (max)" in line]
    assert len(best) == 1 and best[0] in ("1", "2", "3"), listed.out
    again = _hosts(["resume"], hosts, [None, None], ["--epoch", "best", "max_epochs=4"])
    assert [p.returncode for p in again] == [0, 0], [p.stdout + p.stderr for p in again]
    assert f"resumed from checkpoint epoch {best[0]}" in again[0].stdout, again[0].stdout


def test_a_replicas_dataloader_workers_start_as_in_one_process(tmp_path):
    """The launcher spawns the ranks; their DataLoaders must not spawn their workers (a new
    interpreter importing torch every pass made an epoch of 2 replicas 20x slower)."""
    import multiprocessing

    (tmp_path / "plan.yaml").write_text(
        "job: start\nmax_epochs: 1\nepoch:\n  - task: t\n    do:\n"
        "      - call: {fn: \"jobrun_test_helpers:start_method\", out: how, pure: true}\n"
        "      - log: {in: [how]}\n")
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2")
    assert r.code == 0, r.out + r.err
    assert [v["how"] for v in logged(tmp_path / "run")] == [multiprocessing.get_all_start_methods()[0]]
