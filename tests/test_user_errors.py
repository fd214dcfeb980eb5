"""A failure in the user's own code (a `call`ed function, a built class) is shown as one
line naming the op, the plan's file:line and the function, with the user's frames only
under it; run.json says "failed" or "interrupted" whatever was raised."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from jobrun_test_helpers import mlp_plan
from runner_util import jobrun

from jobrun.errors import RunError
from jobrun.runner import usertrace

USER_CODE = """\
def helper(x):
    return 1 / x


def divide():
    return helper(0)


def stop():
    raise KeyboardInterrupt


class Net:
    def __init__(self, width):
        if width < 0:
            raise ValueError(f"width {width} < 0")
"""

PLAN = """\
job: oops
max_epochs: 1
init:
  - task: setup
    do:
      - const: {{out: a, value: 1}}
epoch:
  - task: go
    do:
      - {step}
"""


def _train(tmp_path, module: str, step: str):
    (tmp_path / f"{module}.py").write_text(USER_CODE)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(step=step.replace("MOD", module)))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    return r, json.loads((tmp_path / "run" / "run.json").read_text())


def test_a_called_function_that_raises_shows_its_own_frames_under_the_op_line(tmp_path):
    r, info = _train(tmp_path, "user_divide", 'call: {fn: "MOD:divide", out: b}')
    assert r.code == 1
    lines = r.err.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'plan.yaml'}:10:9: error: op `call` in task 'go'")
    assert "failed: ZeroDivisionError: division by zero (in user_divide.divide)" in lines[0]
    assert lines[1].strip() == "traceback of your code (most recent call last):"
    frames = [line.strip() for line in lines if line.strip().startswith("File ")]
    assert frames == [f'File "{tmp_path / "user_divide.py"}", line 6, in divide',
                      f'File "{tmp_path / "user_divide.py"}", line 2, in helper']
    assert "jobrun/" not in r.err and "Traceback" not in r.err
    assert lines[-1].strip() == "ZeroDivisionError: division by zero"
    assert info["status"] == "failed" and "user_divide.divide" in info["error"]


def test_a_built_class_that_raises_shows_its_frames_and_the_ops_hint(tmp_path):
    r, info = _train(tmp_path, "user_net", 'build: {target: "MOD:Net", args: [-1], out: net}')
    assert r.code == 1
    assert "op `build`" in r.err and "user_net:Net(...) failed: ValueError: width -1 < 0" in r.err
    assert f'File "{tmp_path / "user_net.py"}", line 16, in __init__' in r.err
    assert r.err.rstrip().splitlines()[-1].strip().startswith("hint: check the arguments")
    assert info["status"] == "failed"


def test_a_keyboard_interrupt_raised_by_user_code_records_interrupted(tmp_path):
    r, info = _train(tmp_path, "user_stop", 'call: {fn: "MOD:stop", out: b}')
    assert r.code == 130 and "stopped by SIGINT" in r.err
    assert info["status"] == "interrupted"


def test_a_system_exit_raised_by_user_code_records_failed(tmp_path):
    r, info = _train(tmp_path, "user_exit", 'call: {fn: "sys:exit", in: [a], out: b}')
    assert r.code == 1 and "SystemExit" in r.err
    assert info["status"] == "failed"


def test_an_error_of_jobrun_alone_has_no_user_trace():
    try:
        raise RunError("plain")
    except RunError as e:
        assert usertrace.of(e) is None
    try:
        {}["missing"]  # raised here, in a test file: a user's frame
    except KeyError as e:
        found = usertrace.of(e)
    assert found is not None and found.function.endswith("test_an_error_of_jobrun_alone_has_no_user_trace")
    assert "KeyError: 'missing'" in found.text


RANK1_CODE = """\
import os


def boom(x):
    if os.environ.get("RANK") == "1":
        raise ValueError("rank 1 data is bad")
    return x
"""

TORCHRUN_PLAN = mlp_plan("tr", "seed: 0\nmax_epochs: 2\ncheckpoint: {dir: ckpt}",
                         init=["const: {out: n, value: 0}"], epoch=['call: {fn: "user_rank1:boom", in: [n], out: m}'])


@pytest.mark.slow
def test_under_torchrun_a_failure_of_rank_1_is_its_message_everywhere(tmp_path):
    """Rank 0 meets the broken connection in the runner's own collective (after the epoch),
    where it printed jobrun's raw traceback; torchrun's summary said "To enable traceback"."""
    (tmp_path / "user_rank1.py").write_text(RANK1_CODE)
    (tmp_path / "plan.yaml").write_text(TORCHRUN_PLAN)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "jobrun", "train", str(tmp_path / "plan.yaml"), "--run-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    head = "error: op `call` in task 'train' on node 'local' (rank 1) failed: " \
           "ValueError: rank 1 data is bad (in user_rank1.boom)"
    assert f"[rank 1] {tmp_path / 'run' / 'plan.yaml'}:" in out and head in out, out
    assert "[rank0]: Traceback" not in out and "jobrun/runner" not in out, out
    # torchrun's own summary names jobrun's message as the root cause.
    assert f"traceback : [rank 1] {tmp_path / 'run' / 'plan.yaml'}" in out, out


@pytest.mark.slow
def test_on_two_hosts_the_other_host_prints_the_failed_ranks_message(tmp_path):
    """Two torchrun agents, one rank each (two "hosts"): host 0 printed its own broken
    connection ("Connection closed by peer") as jobrun's error; now rank 1's message."""
    import socket

    (tmp_path / "user_rank1.py").write_text(RANK1_CODE)
    (tmp_path / "plan.yaml").write_text(TORCHRUN_PLAN)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-hosts",
           "-m", "jobrun", "train", "plan.yaml", "--run-dir", "run"]
    hosts = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=tmp_path) for _ in range(2)]
    outs = [h.communicate(timeout=240)[0] for h in hosts]
    assert all(h.returncode != 0 for h in hosts)
    message = (r"\[rank 1\] run/plan.yaml:\d+:5: error: op `call` in task 'train' on node 'local' \(rank 1\) "
               r"failed: ValueError: rank 1 data is bad \(in user_rank1.boom\)")
    for out in outs:  # each host prints the message, never its own broken connection
        assert re.search(f"^{message}$", out, re.M), out
        assert "error: RuntimeError" not in out and "[rank0]: Traceback" not in out, out
    # torchrun's summary names it as the root cause (on host 0 too, unless its agent lost
    # the rendezvous store first, when host 1's agent held it: torchrun's own error then).
    assert any(re.search(f"traceback : {message}", out) for out in outs), outs


@pytest.mark.slow
def test_with_replicas_run_json_keeps_the_failed_ranks_own_message(tmp_path):
    from runner_util import jobrun_proc

    (tmp_path / "user_rank1.py").write_text(RANK1_CODE)
    (tmp_path / "plan.yaml").write_text(TORCHRUN_PLAN)
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2",
                    cwd=tmp_path, timeout=240)
    assert r.code == 1 and "error: replica rank 1 failed (exit code 1)" in r.err, r.text
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "failed"
    assert info["error"].startswith(f"[rank 1] {tmp_path / 'plan.yaml'}:21:9: error: op `call`")
    assert info["error"].endswith("failed: ValueError: rank 1 data is bad (in user_rank1.boom)")
