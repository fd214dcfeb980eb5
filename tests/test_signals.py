"""Ctrl-C, SIGTERM and SIGUSR1 at any moment of a run's start: a clean exit 130/143, one message,
no crash, no traceback, and no `jobrun resume` offered when there is nothing to resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_util import HANG_S

pytestmark = pytest.mark.slow

PLAN = Path(__file__).resolve().parent.parent / "plans" / "mlp.yaml"

SLOW_INIT = """\
job: slowinit
max_epochs: 2
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - model.mlp: {out: model, sizes: [4, 4]}
      - call: {fn: "jobrun_test_helpers:touch", path: "${run_dir}/../init-started"}
      - call: {fn: "jobrun_test_helpers:sleep", seconds: 60}
epoch:
  - task: t
    do: [{const: {out: x, value: 1}}]
"""


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jobrun", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


# The interpreter's own start-up (before any of jobrun's code runs) is outside jobrun's
# reach: this starts timing once `jobrun.cli` is imported, as the `jobrun` script does.
_ENTRY = ("import sys; import jobrun.cli as cli; print('ready', flush=True); "
          "sys.argv[0] = 'jobrun'; cli.main()")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
@pytest.mark.parametrize("delay", [0.0, 0.2, 0.5, 0.9])
def test_a_signal_during_start_up_exits_cleanly(tmp_path, sig, delay):
    p = subprocess.Popen([sys.executable, "-c", _ENTRY, "train", str(PLAN), "--run-dir",
                          str(tmp_path / "run")], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    time.sleep(delay)
    p.send_signal(sig)
    out, err = p.communicate(timeout=HANG_S)
    assert p.returncode == 128 + sig, (p.returncode, out, err)
    assert "Traceback" not in out + err
    assert signal.Signals(sig).name in err, (out, err)
    if "nothing was written" in err:  # it came before train wrote anything: it wrote nothing
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_init_says_so_and_offers_no_resume(tmp_path, sig):
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT)
    p = _start(["train", str(plan), "--run-dir", str(tmp_path / "run")], tmp_path)
    deadline = time.monotonic() + HANG_S
    while not (tmp_path / "init-started").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(sig)
    out, err = p.communicate(timeout=HANG_S)
    assert p.returncode == 128 + sig, (out, err)
    assert f"interrupted during init ({signal.Signals(sig).name})" in err
    assert "resume" not in out + err and "Traceback" not in out + err
    assert "failed" not in err  # not an op failure


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_it_again(tmp_path):
    """SLURM's USR1 during init, then the requeued job script resumes the run its run.json
    names: "no complete checkpoint", exit 1, and the script never requeued (docs/multi-host.md).
    Nothing was saved, so resuming is training it again from init, in its own directory."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace('{fn: "jobrun_test_helpers:sleep", seconds: 60}',
                                      '{fn: "jobrun_test_helpers:wait_while", path: "${run_dir}/../hold"}'))
    (tmp_path / "hold").touch()
    run = tmp_path / "run"
    p = _start(["train", str(plan), "--run-dir", str(run)], tmp_path)
    deadline = time.monotonic() + HANG_S
    while not (tmp_path / "init-started").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    out, err = p.communicate(timeout=HANG_S)
    assert p.returncode == 128 + signal.SIGUSR1, (out, err)
    (tmp_path / "hold").unlink()
    asked = subprocess.run([sys.executable, "-m", "jobrun", "resume", str(run), "--epoch", "0"],
                           capture_output=True, text=True, timeout=HANG_S)
    assert asked.returncode == 2 and "no checkpoint of epoch 0 in" in asked.stderr  # asked for
    r = subprocess.run([sys.executable, "-m", "jobrun", "resume", str(run)], capture_output=True, text=True,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert "stopped before its first checkpoint, so nothing was saved: it starts again from init" in r.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["last_epoch"] == 2 and info["error"] is None, info
    assert sorted(p.name for p in (run / "ckpt").iterdir() if not p.name.startswith(".")) == \
        ["local.0", "local.1", "local.2"]


def test_a_signal_after_checkpoint_0_offers_resume_with_the_run_dir(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace(
        "      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}\n", "").replace(
        "    do: [{const: {out: x, value: 1}}]",
        "    do: [{call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}}]"))
    run = tmp_path / "run"
    p = _start(["train", str(plan), "--run-dir", str(run)], tmp_path)
    deadline = time.monotonic() + HANG_S
    while not list(run.glob("ckpt/local.0/rank-0/COMMIT")):
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=HANG_S)
    assert p.returncode == 130, (out, err)
    assert "stopped by SIGINT" in out + err
    assert f"jobrun resume {run}" in out + err


def test_a_signal_before_a_resume_restored_its_checkpoint_offers_that_resume_again(tmp_path):
    """`resume --epoch 1 max_epochs=3` stopped in its init left the run as it was (finished
    at epoch 2): the `jobrun resume RUN` it offered said 'already finished; nothing to do'.
    It offers the same resume again, which goes back as asked."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace('{fn: "jobrun_test_helpers:sleep", seconds: 60}',
                                      '{fn: "jobrun_test_helpers:wait_while", path: "${run_dir}/../hold"}'))
    run = tmp_path / "run"
    assert subprocess.run([sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(run)],
                          capture_output=True, timeout=HANG_S).returncode == 0
    def records():  # the checkpoints, run.json, plan.yaml, metrics.jsonl (console.log tells of the try)
        return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name in (
            "run.json", "plan.yaml", "metrics.jsonl", "MANIFEST.json", "COMMIT", "values.json", "tensors.safetensors")}

    saved = records()
    (tmp_path / "init-started").unlink()
    (tmp_path / "hold").touch()
    p = _start(["resume", "run", "--epoch", "1", "max_epochs=3"], tmp_path)
    deadline = time.monotonic() + HANG_S
    while not (tmp_path / "init-started").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=HANG_S)
    assert p.returncode == 130 and "Traceback" not in err, (out, err)
    assert "hint: continue with `jobrun resume run max_epochs=3 --epoch 1`" in err, err
    assert records() == saved and len(saved) > 8
    (tmp_path / "hold").unlink()
    r = subprocess.run([sys.executable, "-m", "jobrun", "resume", "run", "max_epochs=3", "--epoch", "1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and "resumed from checkpoint epoch 1" in r.stdout + r.stderr, r.stderr
    assert json.loads((run / "run.json").read_text())["last_epoch"] == 3


def test_a_signal_as_run_json_says_running_leaves_the_run_interrupted_not_died(tmp_path):
    """Ctrl-C just after `train` wrote run.json (before the job runner's handler took
    over) stopped it 'interrupted during start-up' and left run.json 'running': `jobrun
    runs` called the run died, as if it had been killed without a word."""
    run = tmp_path / "run"
    p = _start(["train", str(PLAN), "--run-dir", str(run)], tmp_path)
    deadline = time.monotonic() + HANG_S
    while p.poll() is None:
        assert time.monotonic() < deadline
        try:
            if json.loads((run / "run.json").read_text())["status"] == "running":
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.001)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=HANG_S)
    assert p.returncode == 130 and "Traceback" not in err, (out, err)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted" and "SIGINT" in info["error"], (info, err)
    listed = subprocess.run([sys.executable, "-m", "jobrun", "runs", str(run)], capture_output=True,
                            text=True, timeout=HANG_S)
    assert " interrupted " in listed.stdout and " died " not in listed.stdout, listed.stdout


def test_a_worker_whose_launcher_is_gone_after_its_job_leaves(tmp_path):
    """torch's wrapper of a spawned rank waits, without a timeout, for its launcher once
    the job is done: a launcher killed then left its ranks waiting for good. A rank that
    watches its launcher (signals.watch_launcher) leaves when it goes."""
    import subprocess
    import sys
    import time

    child = ("import os, threading, sys\nfrom jobrun import signals\nsignals.watch_launcher(os.getppid())\n"
             "signals.exit_when_orphaned(7, every=0.05)\nprint('ready', flush=True)\n"
             "threading.Event().wait()\n")
    launcher = ("import subprocess, sys\n"
                f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
                "assert p.stdout.readline() == 'ready\\n'\nprint(p.pid, flush=True)\n")  # then it exits
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + HANG_S  # it polls every 0.05 s: a loaded machine may be slow
    while time.monotonic() < deadline:
        try:  # a zombie has exited too (a container's PID 1 may not reap the orphan)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError("the orphaned worker is still waiting")


def test_a_rank_forked_by_another_process_gets_sigint_when_its_launcher_dies():
    """The ranks' parent is the launcher's fork server, which outlives the launcher while
    they run: a rank watches the launcher's own pid and sends itself the SIGINT a parent's
    death gave it (torch's parent-death signal)."""
    import subprocess
    import sys

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child = ("import os, signal, sys, time\nfrom jobrun import signals\n"
             "signal.signal(signal.SIGINT, lambda *_: (print('sigint', flush=True), os._exit(3)))\n"
             "signals.watch_launcher(int(sys.argv[1]))\n"
             "assert not signals.orphaned()\nprint('ready', flush=True)\ntime.sleep(120)\n")
    rank = subprocess.Popen([sys.executable, "-c", child, str(launcher.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "ready\n"
        launcher.kill()
        launcher.wait()
        assert rank.wait(timeout=HANG_S) == 3
        assert rank.stdout.read() == "sigint\n"
    finally:
        launcher.kill()
        rank.kill()
        rank.stdout.close()


def test_a_rank_meeting_the_others_leaves_at_once_when_its_launcher_dies():
    """A launcher killed while its ranks built their process group left a rank that was
    connecting to the launcher's rendezvous store retrying for JOBRUN_DIST_TIMEOUT (300 s),
    the SIGINT of its death held off by the C++ call, and the fork server and the resource
    tracker alive with it. Here the launcher's store has accepted the rank's connection
    and not answered yet, as a store in a launcher being killed; then the launcher dies."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import socket, time\ns = socket.create_server(('127.0.0.1', 0))\n"
         "print(s.getsockname()[1], flush=True)\nc = s.accept()\nprint('connected', flush=True)\n"
         "time.sleep(600)\n"], stdout=subprocess.PIPE, text=True)
    rank_code = ("import sys\nfrom jobrun import signals\nfrom jobrun.runner import group\n"
                 "signals.watch_launcher(int(sys.argv[1]))\ngroup.start('cpu')\n")
    try:
        port = launcher.stdout.readline().strip()
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "TORCHELASTIC_USE_AGENT_STORE": "True", "JOBRUN_DIST_TIMEOUT": "300"}
        rank = subprocess.Popen([sys.executable, "-c", rank_code, str(launcher.pid)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert launcher.stdout.readline() == "connected\n"  # the rank waits for the store's answer
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        try:
            out, err = rank.communicate(timeout=60)
        finally:
            rank.kill()
        assert time.monotonic() - killed < 30, err
        assert rank.returncode == 128 + signal.SIGINT, err
        assert "interrupted during start-up (the launcher went away (killed?)" in err, err
        assert "Traceback" not in err, err
    finally:
        launcher.kill()
        launcher.stdout.close()


def test_a_signal_during_checkpoint_0_stops_after_it_and_offers_resume(tmp_path, monkeypatch):
    """A stop that comes while checkpoint 0 is written waits for it, then stops: it said
    "interrupted during init" and offered no resume, though checkpoint 0 was saved."""
    from runner_util import jobrun

    from jobrun.runner.checkpoints import Checkpoints

    write_all = Checkpoints._write_all

    def signalled_while_writing(self, epoch, prepared):
        if epoch == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler defers it: a save is running
        return write_all(self, epoch, prepared)

    monkeypatch.setattr(Checkpoints, "_write_all", signalled_while_writing)
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace("      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}\n", ""))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 143 and list(run.glob("ckpt/local.0/rank-0/COMMIT")), r.text
    assert "during init" not in r.text and f"jobrun resume {run}" in r.text


@pytest.mark.parametrize("during_save, twice", [(True, False), (True, True), (False, True)])
def test_a_signal_during_an_epochs_save_records_that_epoch_before_it_stops(tmp_path, monkeypatch,
                                                                          during_save, twice):
    """Ctrl-C while epoch 1 is saved: the save finished, but the stop came before the
    epoch's line, its metrics.jsonl record and the trackers' values, which the resume
    (going on with epoch 2) never wrote: missing for good. A second Ctrl-C as the epoch
    is recorded waits for it too, and so does a first one that comes just after the save."""
    from runner_util import jobrun

    from jobrun.runner.checkpoints import Checkpoints
    from jobrun.runner.display import Display

    write_all = Checkpoints._write_all
    epoch_line = Display.epoch_line

    def signalled_while_writing(self, epoch, prepared):
        if during_save and epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the handler defers it: a save is running
        return write_all(self, epoch, prepared)

    def signalled_again(self, result, *args):
        if twice and result.epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return epoch_line(self, result, *args)

    monkeypatch.setattr(Checkpoints, "_write_all", signalled_while_writing)
    monkeypatch.setattr(Display, "epoch_line", signalled_again)
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace("      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}\n", "")
                    .replace("max_epochs: 2", "max_epochs: 2\nloggers: [csv]")
                    .replace("do: [{const: {out: x, value: 1}}]",
                             "do: [{const: {out: x, value: 1}}]\n    outputs: [x]"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 130 and list(run.glob("ckpt/local.1/rank-0/COMMIT")), r.text
    assert "epoch 1/2" in r.out and f"jobrun resume {run}" in r.err, r.text
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in records if m.get("event") == "epoch"] == [1]
    assert "epoch/t/x,1.0" in (run / "metrics.csv").read_text()
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"


def test_a_signal_after_a_deferred_one_stopped_the_run_still_interrupts_its_close(tmp_path, monkeypatch):
    """Once a signal deferred by a save had stopped the run, every later one was ignored
    for good: a close that hangs (a tracker's) could only be left with kill -9."""
    from runner_util import jobrun

    from jobrun.runner.checkpoints import Checkpoints
    from jobrun.runner.records import Metrics

    write_all, close = Checkpoints._write_all, Metrics.close
    waited: list[float] = []

    def signalled_while_writing(self, epoch, prepared):
        if epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)  # deferred: the save finishes, then the run stops
        return write_all(self, epoch, prepared)

    def hangs(self):
        if not waited:
            t0 = time.monotonic()
            waited.append(0.0)
            try:
                os.kill(os.getpid(), signal.SIGINT)  # the user's second Ctrl-C
                time.sleep(20)
            finally:
                waited[0] = time.monotonic() - t0
        return close(self)

    monkeypatch.setattr(Checkpoints, "_write_all", signalled_while_writing)
    monkeypatch.setattr(Metrics, "close", hangs)
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace("      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}\n", ""))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 130 and waited and waited[0] < 10, (waited, r.text)


def test_a_second_signal_while_the_stop_waits_for_an_async_save_lets_it_finish(tmp_path, monkeypatch):
    """Ctrl-C twice while checkpoint 0 is written in the background: the second one,
    during the stop's wait for the write, ended the process mid-write ("FATAL: exception
    not rethrown", SIGABRT, the epoch half written); and once the write was waited for,
    it skipped closing the run's files (TensorBoard's last scalars, the trackers' last
    batch) and its hint lost the run directory."""
    pytest.importorskip("tensorboard")
    import threading

    from runner_util import jobrun

    from jobrun.runner.checkpoints import Checkpoints

    write_all = Checkpoints._write_all
    written: list[int] = []
    main = threading.main_thread().ident

    def signalled_twice(self, epoch, prepared):
        if epoch == 0:  # in the writer's thread: the main thread stops, then waits for it here
            time.sleep(0.5)  # epoch 1 logged its value and sleeps
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.3)
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.3)
        done = write_all(self, epoch, prepared)
        written.append(epoch)
        return done

    monkeypatch.setattr(Checkpoints, "_write_all", signalled_twice)
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace("      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}\n", "")
                    .replace("checkpoint: {dir: ckpt}", "checkpoint: {dir: ckpt, async: true}")
                    .replace("do: [{const: {out: x, value: 1}}]",
                             "do: [{const: {out: x, value: 1}}, {log: {in: [x]}}, "
                             "{call: {fn: \"jobrun_test_helpers:sleep\", seconds: 3}}]"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert written == [0], r.text  # it left once checkpoint 0 was written
    assert r.code == 130 and list(run.glob("ckpt/local.0/rank-0/COMMIT")), r.text
    assert "Traceback" not in r.err and f"jobrun resume {run}" in r.err, r.text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("t/x")] == [1.0], r.text  # closed: its last values written


def test_a_signal_as_a_finished_job_closes_leaves_it_finished_and_says_so(tmp_path, monkeypatch):
    """Ctrl-C just after "job ... finished": it said "interrupted during start-up ...
    nothing was written" (the start-up handler was back), or "stopped by SIGINT" with a
    resume to do; run.json rightly says finished."""
    import json

    from runner_util import jobrun

    from jobrun import signals
    from jobrun.errors import Interrupted
    from jobrun.runner.job import JobRunner

    summary = JobRunner._summary

    def signalled(self):
        summary(self)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(JobRunner, "_summary", signalled)
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace("      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}\n", ""))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 130 and "interrupted during closing, after the job finished (SIGINT)" in r.err, r.text
    assert "resume" not in r.err and json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
    signals.job_finished()  # once the job finished, the process's own handler says so too
    with pytest.raises(Interrupted, match="during closing, after the job finished"):
        signals._raise(signal.SIGINT, None)
    signals.exit_at_once()  # the next command starts anew
    signals.end_start_up()
    with pytest.raises(Interrupted, match="during start-up"):
        signals._raise(signal.SIGINT, None)


@pytest.mark.parametrize(("first", "background"), [("record", False), ("record", True), ("epoch", False)])
def test_two_quick_signals_as_a_run_stops_leave_the_stop_recorded(tmp_path, monkeypatch, first, background):
    """Ctrl-C just after epoch 1's save returned (an async write goes on), before its
    line and metrics record, or during the epoch; then again while the stop was recorded
    (the hint's `jobrun resume` scans ./runs, slow with many runs): the epoch record was lost,
    run.json stayed "running" (`jobrun runs` said died) and the hint lost the run
    directory. A third Ctrl-C, as the run closes (a tracker may take minutes), still
    gets out at once, saying how to go on."""
    from runner_util import jobrun

    from jobrun import hints
    from jobrun.runner.display import Display
    from jobrun.runner.monitor import Watch
    from jobrun.runner.records import Metrics

    epoch_line, after_epoch = Display.epoch_line, Watch.after_epoch
    is_latest, close = hints._is_latest, Metrics.close
    closing: list[str] = []

    def signalled(self, result, *args):
        if result.epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the save returned: nothing defers it yet
        return epoch_line(self, result, *args)

    def signalled_in_the_epoch(self, outputs, epoch):
        if epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return after_epoch(self, outputs, epoch)

    def signalled_again(run):
        os.kill(os.getpid(), signal.SIGINT)
        return is_latest(run)

    def signalled_as_it_closes(self):
        closing.append("metrics")
        close(self)
        os.kill(os.getpid(), signal.SIGINT)
        closing.append("not left")

    if first == "record":
        monkeypatch.setattr(Display, "epoch_line", signalled)
    else:
        monkeypatch.setattr(Watch, "after_epoch", signalled_in_the_epoch)
    monkeypatch.setattr(hints, "_is_latest", signalled_again)
    monkeypatch.setattr(Metrics, "close", signalled_as_it_closes)
    plan = tmp_path / "plan.yaml"
    plan.write_text(SLOW_INIT.replace("      - call: {fn: \"jobrun_test_helpers:sleep\", seconds: 60}\n", "")
                    .replace("checkpoint: {dir: ckpt}", f"checkpoint: {{dir: ckpt, async: {str(background).lower()}}}")
                    .replace("do: [{const: {out: x, value: 1}}]",
                             "do: [{const: {out: x, value: 1}}]\n    outputs: [x]"))
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 130 and f"jobrun resume {run}" in r.err, r.text
    saved = [1] if first == "record" else []
    assert [p.parent.parent.name for p in run.glob("ckpt/local.1/rank-0/COMMIT")] == [f"local.{e}" for e in saved]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in records if m.get("event") == "epoch"] == saved, r.text
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    assert closing == ["metrics"], r.text  # the third signal: out, not waiting for the rest


def test_the_fork_server_of_the_ranks_stops_at_once():
    """The launcher stops its fork server when the ranks have ended, and waits for it:
    the server's exit tore down an interpreter that imported torch, 2 s on a loaded
    machine added to the end of every run of replicas and to every Ctrl-C's answer. It
    ends with the atexit handlers, not with the teardown."""
    import multiprocessing

    from jobrun.runner import forkserver

    if forkserver.start_method() != "forkserver":
        pytest.skip("no pidfd here: the ranks are spawned")
    rank = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    rank.start()
    rank.join()
    assert rank.exitcode == 0
    started = time.monotonic()
    forkserver.stop()
    assert time.monotonic() - started < 1.0


def test_a_signal_to_a_command_that_runs_no_job_says_interrupted_not_during_start_up(tmp_path, monkeypatch):
    """Ctrl-C during `jobrun runs` or `ckpt verify` (reading many checkpoints) said
    "interrupted during start-up (SIGINT)", a phase those commands do not have."""
    from runner_util import jobrun

    from jobrun import signals
    from jobrun.errors import Interrupted
    from jobrun.runner import runs

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return ""

    monkeypatch.setattr(runs, "runs_text", signalled)
    r = jobrun("runs", tmp_path)
    assert r.code == 130 and "interrupted (SIGINT)" in r.err, r.text
    assert "start-up" not in r.err and "resume" not in r.err, r.text
    with pytest.raises(Interrupted, match="during start-up"):  # the next command starts anew
        signals._raise(signal.SIGINT, None)
