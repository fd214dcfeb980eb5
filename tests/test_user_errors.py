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


class Unsayable(Exception):
    def __str__(self):
        raise RuntimeError("str fails")


def unsayable():
    raise Unsayable()


def long_winded():
    raise ValueError("x" * 100_000)


class Net:
    def __init__(self, width):
        if width < 0:
            raise ValueError(f"width {width} < 0")


class Loaded:
    def __init__(self):
        import torch

        torch.nn.Linear(2, 3).load_state_dict(torch.nn.Linear(2, 4).state_dict())
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


def _error_lines(err: str) -> list[str]:
    """stderr's lines after the analyze warnings train prints first (these plans leave a
    blob unread)."""
    lines = err.splitlines()
    while lines and lines[0].startswith(("warning: ", "  (`jobrun analyze PLAN`")):
        lines.pop(0)
    return lines


def _train(tmp_path, module: str, step: str):
    (tmp_path / f"{module}.py").write_text(USER_CODE)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.format(step=step.replace("MOD", module)))
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    return r, json.loads((tmp_path / "run" / "run.json").read_text())


def test_a_called_function_that_raises_shows_its_own_frames_under_the_op_line(tmp_path):
    r, info = _train(tmp_path, "user_divide", 'call: {fn: "MOD:divide", out: b}')
    assert r.code == 1
    lines = _error_lines(r.err)
    assert lines[0].startswith(f"{tmp_path / 'plan.yaml'}:10:9: error: op `call` in task 'go'")
    assert "failed: ZeroDivisionError: division by zero (in user_divide.divide)" in lines[0]
    assert lines[1].strip() == "traceback of your code (most recent call last):"
    frames = [line.strip() for line in lines if line.strip().startswith("File ")]
    assert frames == [f'File "{tmp_path / "user_divide.py"}", line 6, in divide',
                      f'File "{tmp_path / "user_divide.py"}", line 2, in helper']
    assert "jobrun/" not in r.err and "Traceback" not in r.err
    assert lines[-1].strip() == "ZeroDivisionError: division by zero"
    assert info["status"] == "failed" and "user_divide.divide" in info["error"]


def test_an_exception_whose_text_fails_or_is_huge_is_still_one_short_message(tmp_path):
    # A __str__ that raised gave jobrun's own traceback; a 100 kB text was printed twice.
    r, info = _train(tmp_path, "user_unsayable", 'call: {fn: "MOD:unsayable", out: b}')
    assert r.code == 1 and "Traceback" not in r.err and "jobrun/" not in r.err, r.err
    assert "failed: Unsayable: <Unsayable: its str() raised> (in user_unsayable.unsayable)" in r.err
    assert info["status"] == "failed"
    r, info = _train(tmp_path, "user_long", 'call: {fn: "MOD:long_winded", out: b}')
    assert r.code == 1 and "Traceback" not in r.err
    assert len(r.err) < 6000 and r.err.count("more characters)") == 2, r.err[-300:]
    assert len(info["error"]) < 6000


def test_a_built_class_that_raises_is_reported_as_a_called_function_is(tmp_path):
    """A constructor that raised (a pretrained checkpoint's load_state_dict, shapes that do
    not fit) was said twice, in the op's line and at the end of the trace, with the hint
    "check the arguments given in the plan against its signature", which points away from
    the user's code at fault: it is now said as a `call`'s failure is, the hint kept for
    arguments that do not bind."""
    r, info = _train(tmp_path, "user_net", 'build: {target: "MOD:Net", args: [-1], out: net}')
    assert r.code == 1
    lines = _error_lines(r.err)
    assert "op `build`" in lines[0] and lines[0].endswith("failed: ValueError: width -1 < 0 (in user_net.Net.__init__)")
    assert f'File "{tmp_path / "user_net.py"}", line 29, in __init__' in r.err
    assert lines[-1].strip() == "ValueError: width -1 < 0" and "hint:" not in r.err, r.err
    assert info["status"] == "failed"
    r, info = _train(tmp_path, "user_load", 'build: {target: "MOD:Loaded", out: net}')
    lines = _error_lines(r.err)
    assert lines[0].endswith("failed: RuntimeError: Error(s) in loading state_dict for Linear: ... "
                             "(in user_load.Loaded.__init__)"), r.err
    assert r.err.count("size mismatch for weight") == 1 and "hint:" not in r.err, r.err
    assert lines[-1].strip().startswith("size mismatch for bias") and info["status"] == "failed"
    # range has no signature Python can read: train cannot bind it before the run
    r, _ = _train(tmp_path, "user_bind", 'build: {target: "builtins:range", out: net}')
    assert r.code == 1 and "traceback of your code" not in r.err, r.err
    assert "builtins:range(...) cannot take the arguments given: range expected at least 1 argument" in r.err
    assert r.err.rstrip().splitlines()[-1].strip().startswith("hint: check the arguments")
    # one with a signature is refused before the run, at the step (test_cli_runs)
    (tmp_path / "plan.yaml").write_text(PLAN.format(step='build: {target: "user_bind:Net", out: net}'))  # no width
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "bound")
    assert r.code == 2 and "build: Net(width) cannot take what this step gives it: missing a required argument: " \
        "'width'" in r.err and not (tmp_path / "bound").exists(), r.err


def test_a_keyboard_interrupt_raised_by_user_code_records_interrupted(tmp_path):
    r, info = _train(tmp_path, "user_stop", 'call: {fn: "MOD:stop", out: b}')
    assert r.code == 130 and "stopped by SIGINT" in r.err
    assert info["status"] == "interrupted"


def test_a_system_exit_raised_by_user_code_records_failed(tmp_path):
    r, info = _train(tmp_path, "user_exit", 'call: {fn: "sys:exit", in: [a], out: b}')
    assert r.code == 1 and "SystemExit" in r.err
    assert info["status"] == "failed"


TORCH_CODE = """\
import torch
import torch.nn.functional as F


def step(model, opt, xb, yb):
    opt.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    return loss


class Mismatched(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 3)
        self.second = torch.nn.Linear(8, 2)  # 8: should be 3

    def forward(self, x):
        h = self.first(x)
        return self.second(h)


class Recurrent(torch.nn.Module):  # word_language_model's forward(input, hidden)
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 2)

    def forward(self, x, hidden):
        return self.rnn(x[None], hidden)[0][0]
"""

TORCH_PLAN = """\
job: torchy
seed: 0
max_epochs: 1
init:
  - task: setup
    do:
      - data.synthetic: {{out: [x, y], task: classification, n: 32, features: 4, classes: 2}}
      - reader: {{in: [x, y], out: data, batch_size: 16}}
      - {model}
      - optimizer: {{in: model, out: opt, lr: 0.1}}
epoch:
  - task: train
    do:
      - loop: 3
        do:
          - read: {{in: data, out: [xb, yb, end]}}
          - {step}
"""


def _train_torch(tmp_path, module: str, model: str, step: str):
    (tmp_path / f"{module}.py").write_text(TORCH_CODE)
    plan = tmp_path / "plan.yaml"
    plan.write_text(TORCH_PLAN.format(model=model.replace("MOD", module), step=step.replace("MOD", module)))
    return jobrun("train", plan, "--run-dir", tmp_path / "run")


def test_a_call_given_the_null_batch_of_a_finished_read_names_the_input_and_the_fix(tmp_path):
    # Two batches a pass, three reads and no stop_if: the third read's fields are null.
    r = _train_torch(tmp_path, "user_nullbatch", "model.mlp: {out: model, sizes: [4, 8, 2]}",
                     'call: {fn: "MOD:step", in: [model, opt, xb, yb], out: loss}')
    assert r.code == 1
    lines = _error_lines(r.err)
    assert lines[0] == (f"{tmp_path / 'plan.yaml'}:17:13: error: op `call` in task 'train' on node "
                        "'local': user_nullbatch:step failed (TypeError) with null (None) inputs 'xb', 'yb'")
    hint = lines[-1].strip()
    assert hint.startswith("hint: a `read` past the end of a pass gives null fields") and "stop_if: end" in hint
    assert f'File "{tmp_path / "user_nullbatch.py"}", line 7, in step' in r.err  # the user's frames stay


def test_a_call_that_fails_with_no_null_input_gets_no_null_hint(tmp_path):
    r = _train_torch(tmp_path, "user_nonull", "model.mlp: {out: model, sizes: [4, 8, 2]}",
                     'call: {fn: "MOD:step", in: [model, opt, xb, opt], out: loss}')
    assert r.code == 1 and "(None)" not in r.err and "stop_if" not in r.err
    assert "failed: TypeError:" in _error_lines(r.err)[0]


def test_a_blob_made_only_in_a_loop_that_made_none_says_why(tmp_path):
    # The reader's one pass (passes: 1, the default) is spent in epoch 1: epoch 2's loop
    # stops at its first read, so no train.step defines `loss` for the log after it.
    plan = tmp_path / "plan.yaml"
    plan.write_text(TORCH_PLAN.format(model="model.mlp: {out: model, sizes: [4, 8, 2]}", step="stop_if: end")
                    .replace("max_epochs: 1", "max_epochs: 2").replace("loop: 3", "loop: null")
                    + "          - train.step: {in: [model, opt, xb, yb], out: loss}\n"
                    + "      - log: {in: [loss]}\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 1
    assert "plan.yaml:19:9: error: op `log` in task 'train' on node 'local': blob 'loss' is not defined" in r.err
    assert "hint: 'loss' is made only inside a loop, where no step made it this time" in r.err
    assert "`passes: 0` reads on in every epoch" in r.err
    assert "epoch 1/2" in r.out  # epoch 1 trained


def test_a_function_in_a_module_not_found_shows_no_traceback_of_importlib(tmp_path):
    # Refused before the run directory is made (tests/test_train_early.py has the rest).
    (tmp_path / "plan.yaml").write_text(PLAN.format(step='call: {fn: "user_absent_module:f", out: b}'))
    r = jobrun("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run")
    assert r.code == 2
    assert "fn 'user_absent_module:f' cannot be imported: ModuleNotFoundError" in r.err
    assert "traceback of your code" not in r.err and "importlib" not in r.err
    assert not (tmp_path / "run").exists()


def test_the_batch_ops_give_a_null_batch_the_same_fix():
    from jobrun.ops.data import as_tensor

    with pytest.raises(RunError) as e:
        as_tensor(None, "cpu", "train.step input x")
    assert e.value.message == "train.step input x is null (None)"
    assert "`stop_if: end` right after the read" in e.value.hint


def test_a_shape_error_in_a_models_forward_shows_the_users_frames_and_torchs_raising_line(tmp_path):
    r = _train_torch(tmp_path, "user_shapes", 'build: {out: model, target: "MOD:Mismatched"}',
                     "train.step: {in: [model, opt, xb, yb], out: loss}")
    assert r.code == 1
    assert "mat1 and mat2 shapes cannot be multiplied (16x3 and 8x2) (in user_shapes.Mismatched.forward)" in r.err
    frames = [line.strip() for line in r.err.splitlines() if line.strip().startswith("File ")]
    assert frames[0] == f'File "{tmp_path / "user_shapes.py"}", line 21, in forward'
    # Then only the frame that raised, torch's Linear.forward (F.linear), not Module.__call__'s glue.
    assert len(frames) == 2 and frames[1].endswith("in forward") and "torch/nn/modules/linear.py" in frames[1]
    assert "_call_impl" not in r.err and "module.py" not in r.err


def test_a_model_whose_forward_takes_a_state_too_is_pointed_at_a_call_step(tmp_path):
    """An RNN whose forward takes (input, hidden), trained by train.step, failed with
    "RNNModel.forward() missing 1 required positional argument: 'hidden'" and no hint."""
    r = _train_torch(tmp_path, "user_rnn", 'build: {out: model, target: "MOD:Recurrent"}',
                     "train.step: {in: [model, opt, xb, yb], out: loss}")
    assert r.code == 1 and "Traceback" not in r.err, r.err
    assert "missing 1 required positional argument: 'hidden'" in _error_lines(r.err)[0]
    hint = _error_lines(r.err)[-1].strip()
    assert hint.startswith("hint: train.step and evaluate call `model(x)`") and "a `call`" in hint, r.err
    assert "plan-language.md" in hint


def test_a_torch_model_built_by_the_plan_shows_only_torchs_raising_frame(tmp_path):
    model = ("build: {out: model, target: torch.nn.Sequential, args: [{target: torch.nn.Linear, args: [4, 3]}, "
             "{target: torch.nn.Linear, args: [8, 2]}]}")
    r = _train_torch(tmp_path, "user_unused", model, "train.step: {in: [model, opt, xb, yb], out: loss}")
    assert r.code == 1 and "mat1 and mat2 shapes cannot be multiplied (16x3 and 8x2)" in r.err
    frames = [line.strip() for line in r.err.splitlines() if line.strip().startswith("File ")]
    assert len(frames) == 1 and "torch/nn/modules/linear.py" in frames[0]  # not container.py, module.py


def test_autograd_frames_are_left_out_of_a_backward_that_fails():
    import torch

    x = torch.ones(2, requires_grad=True)
    loss = (x * 2).sum()
    loss.backward()
    try:
        loss.backward()  # the graph is freed: autograd's engine raises
    except RuntimeError as e:
        found = usertrace.of(e)
    assert found is not None
    frames = [line.strip() for line in found.text.splitlines() if line.strip().startswith("File ")]
    assert len(frames) == 1 and frames[0].endswith("in test_autograd_frames_are_left_out_of_a_backward_that_fails")
    assert "Trying to backward through the graph a second time" in found.text


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
    # console.log holds what the console said: the rank's message and the launcher's (the
    # hint sends the user there; they were missing)
    log = (tmp_path / "run" / "console.log").read_text()
    assert "[rank 1] " in log and "failed: ValueError: rank 1 data is bad (in user_rank1.boom)" in log
    assert "error: replica rank 1 failed (exit code 1)" in log


def test_a_failure_in_a_dataloader_worker_names_its_type_once():
    from types import SimpleNamespace

    from jobrun.ops.loader_failures import _failure

    reader = SimpleNamespace(options=SimpleNamespace(name="Pts"))
    caught = RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most "
                          "recent call last):\n  File \"collate.py\", line 9, in f\nRuntimeError: stack "
                          "expects each tensor to be equal size")
    assert _failure(reader, caught).message == (  # type: ignore[arg-type]
        "the reader over Pts failed: RuntimeError: stack expects each tensor to be equal size")
    assert _failure(reader, ValueError("bad")).message == "the reader over Pts failed: ValueError: bad"  # type: ignore[arg-type]


def test_a_stop_when_output_of_several_values_is_refused_at_its_place(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("job: sb\nmax_epochs: 3\nstop_when: [d]\nepoch:\n  - task: t\n    do:\n"
                    "      - fill: {out: d, shape: [3]}\n    outputs: [d]\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 1 and "Traceback" not in r.err, r.err
    assert r.err.startswith(f"{plan}:3:13: error: stop_when 'd': a tensor of shape (3,) has no single truth value")


def test_a_batch_of_another_dtype_than_the_model_gets_a_hint_to_convert_it():
    # float64 samples (numpy's default) from a Dataset: torch's "must have the same dtype"
    # and no hint.
    import torch

    layer = torch.nn.Linear(3, 2)
    for batch, words in ((torch.zeros(4, 3, dtype=torch.float64), "a float64 batch"),
                         (torch.zeros(4, 3, dtype=torch.int64), "an integer batch")):
        with pytest.raises(RuntimeError) as e:
            layer(batch)
        assert usertrace.hint_for(e.value).startswith(words), str(e.value)
    assert usertrace.hint_for(RuntimeError("something else")) is None


@pytest.mark.slow
def test_with_replicas_a_reader_of_fields_given_workers_is_the_jobs_error_said_once(tmp_path):
    # Every replica makes the plan's reader alike: each printed the error, then the
    # launcher added "replica rank 1 failed ... continue with `jobrun resume`", which
    # fails the same way.
    from runner_util import jobrun_proc

    plan = mlp_plan("workers", "max_epochs: 1").replace("passes: 0}", "passes: 0, num_workers: 2}")
    assert "num_workers: 2" in plan
    (tmp_path / "plan.yaml").write_text(plan)
    r = jobrun_proc("train", tmp_path / "plan.yaml", "--run-dir", tmp_path / "run", "--replicas", "2",
                    cwd=tmp_path, timeout=240)
    assert r.code == 1, r.text
    assert r.err.count("num_workers need(s) a torch Dataset as the one input") == 1, r.err
    assert "replica rank" not in r.err and "jobrun resume" not in r.err, r.err
