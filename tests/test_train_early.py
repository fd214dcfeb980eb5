"""`jobrun train` refuses a plan that cannot run before it makes a run directory: code it
names that is not found (a module, a misspelt class), a size given on the command line
that an op refuses (vars.batch=0), a raw `.bin` without its dtype. Each is one message at
the plan's file:line with the fix, exit 2, no traceback, and nothing written: no runs/,
and `--run-dir DIR --overwrite` leaves DIR as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from jobrun_test_helpers import mlp_plan
from runner_util import HANG_S, jobrun, jobrun_proc

MODEL = """\
import torch


class Net(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layer = torch.nn.Linear(4, width)

    def forward(self, x):
        return self.layer(x)


def double(x):
    return x * 2
"""


def _plan(tmp_path, init: str) -> str:
    (tmp_path / "early_models.py").write_text(MODEL)
    (tmp_path / "early_syntax.py").write_text("def f(x):\n    return x +\n")
    (tmp_path / "tokens.bin").write_bytes(bytes(64))
    path = tmp_path / "plan.yaml"
    path.write_text(mlp_plan("early", "max_epochs: 2", init=[init]))
    return str(path)


def _at(tmp_path, token: str) -> str:
    """line:col of the first `token` in the plan."""
    lines = (tmp_path / "plan.yaml").read_text().splitlines()
    number, line = next((n, line) for n, line in enumerate(lines, 1) if token in line)
    return f"{number}:{line.index(token) + 1}"


def _files(run) -> dict:
    """Every file of a run directory and its bytes, but the lock's (the pid holding it)."""
    return {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


# init step, where the message points, the message, the hint
CASES = {
    "class-misspelt": (
        'build: {out: net, target: "early_models:Nett", width: 2}', '"early_models:Nett"',
        "build: target 'early_models:Nett' cannot be imported: 'early_models' has no attribute 'Nett'",
        "did you mean 'Net'?"),
    "module-missing": (
        'call: {fn: "early_modles:double", in: [x], out: x2}', '"early_modles:double"',
        "call: fn 'early_modles:double' cannot be imported: ModuleNotFoundError: No module named 'early_modles'",
        "check the spelling; is the package installed, or the module in the plan's directory"),
    "nested-target": (
        "build: {out: seq, target: torch.nn.Sequential, args: [{target: torch.nn.Lineer, args: [4, 2]}]}",
        "[{target", "build: target 'torch.nn.Lineer' cannot be imported: 'torch.nn' has no attribute 'Lineer'",
        "did you mean 'Linear'?"),
    "loss-path": (
        "evaluate: {in: [model, data], out: [l, a], loss: early_models.nope}", "early_models.nope",
        "evaluate: loss 'early_models.nope' cannot be imported: 'early_models' has no attribute 'nope'",
        "check the spelling of the path"),
    "module-syntax": (  # was left to the run: a run directory of a failed run, exit 1
        'call: {fn: "early_syntax:f", in: [x], out: x2}', '"early_syntax:f"',
        "call: fn 'early_syntax:f' cannot be imported: SyntaxError: invalid syntax (early_syntax.py, line 2)",
        "fix the syntax at /"),
    "bin-without-dtype": (
        "data.load: {out: tokens, path: tokens.bin}", "tokens.bin",
        "data.load: a .bin file is raw and needs its `dtype`, e.g. dtype: uint16 ('tokens.bin')",
        "dtype is one of uint8, int8, uint16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_plan_that_cannot_run_is_refused_before_the_run_directory(case, tmp_path, monkeypatch):
    init, token, message, hint = CASES[case]
    plan = _plan(tmp_path, init)
    monkeypatch.chdir(tmp_path)
    r = jobrun("train", plan)
    assert r.code == 2, r.err
    lines = r.err.splitlines()
    assert lines[0] == f"{plan}:{_at(tmp_path, token)}: error: {message}"
    assert len(lines) == 2 and lines[1].startswith(f"  hint: {hint}"), r.err
    assert not (tmp_path / "runs").exists()


def test_a_batch_size_of_0_on_the_command_line_is_refused_at_the_plans_value(tmp_path, monkeypatch):
    plan = tmp_path / "plan.yaml"
    text = mlp_plan("early", "max_epochs: 2\nvars: {batch: 8}")
    plan.write_text(text.replace("batch_size: 8", 'batch_size: "${batch}"'))
    monkeypatch.chdir(tmp_path)
    r = jobrun("train", plan, "vars.batch=0")
    assert r.code == 2
    where = _at(tmp_path, '"${batch}"')
    assert r.err.splitlines() == [
        f"{plan}:{where}: error: argument `batch_size` of `reader` is 0; expected an integer >= 1",
        "  hint: give `batch_size` an integer >= 1. The value here came from `vars.batch=0` on the command line"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["class-misspelt", "module-syntax"])
def test_overwrite_of_a_run_keeps_it_when_the_plan_is_refused(tmp_path, case):
    good = tmp_path / "good.yaml"
    good.write_text(mlp_plan("early", "max_epochs: 1\ncheckpoint: {}"))
    run = tmp_path / "run"
    assert jobrun("train", good, "--run-dir", run).code == 0
    (run / "notes.txt").write_text("mine")
    before = _files(run)
    r = jobrun("train", _plan(tmp_path, CASES[case][0]), "--run-dir", run, "--overwrite")
    assert r.code == 2 and CASES[case][2] in r.err, r.err
    assert _files(run) == before


def test_in_a_process_of_its_own_the_message_comes_without_a_traceback(tmp_path):
    plan = _plan(tmp_path, CASES["module-missing"][0])
    r = jobrun_proc("train", plan, cwd=tmp_path)
    assert r.code == 2
    assert r.err.startswith(f"{plan}:{_at(tmp_path, CASES['module-missing'][1])}: error: call: fn")
    assert "Traceback" not in r.err and "run directory" not in r.err
    assert not (tmp_path / "runs").exists()


def test_a_module_that_fails_on_its_own_is_left_to_the_run_which_shows_its_traceback(tmp_path):
    (tmp_path / "early_broken.py").write_text("def f(x):\n    return x\n\n\nRATE = 1 / 0\n")
    plan = _plan(tmp_path, 'call: {fn: "early_broken:f", in: [x], out: x2}')
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 1
    assert "fn 'early_broken:f' cannot be imported: ZeroDivisionError: division by zero" in r.err
    assert f'File "{tmp_path / "early_broken.py"}", line 5, in <module>' in r.err
    assert "hint: the module raised while it was imported: fix it" in r.err and "spelling" not in r.err


# -- analyze's warnings, printed by train -----------------------------------------------------

LOSS = "const: {out: loss, value: 0.0}"  # an epoch output defined even where the loop reads nothing


def test_train_prints_analyzes_warnings_once_one_line_each_before_the_run_starts(tmp_path, monkeypatch):
    plan = tmp_path / "plan.yaml"
    plan.write_text(mlp_plan("drained", "max_epochs: 2", init=[LOSS], outputs="[loss]").replace("passes: 0", "passes: 1"))
    monkeypatch.chdir(tmp_path)
    r = jobrun("train", plan)
    assert r.code == 0, r.err
    line, col = _at(tmp_path, "passes: 1").split(":")
    where = f"{line}:{int(col) + len('passes: ')}"  # at the value
    assert r.err.splitlines()[:3] == [
        f"warning: {plan}:{where}: reader 'data' is made once, in init, with passes: 1, and every "
        f"epoch reads it to the end of a pass (line {_at(tmp_path, 'read:').split(':')[0]}): only "
        "the first epoch gets batches, the later ones train on nothing",
        "  (`jobrun analyze PLAN` shows how to fix it)",
        "run directory runs/drained/1"]
    assert r.err.count("warning:") == 1 and "epoch 2/2" in r.out


def test_train_of_a_plan_without_warnings_prints_none(tmp_path, monkeypatch):
    plan = tmp_path / "plan.yaml"
    plan.write_text(mlp_plan("clean", "max_epochs: 1", init=[LOSS], outputs="[loss]"))
    monkeypatch.chdir(tmp_path)
    r = jobrun("train", plan)
    assert r.code == 0 and r.err.splitlines()[0] == "run directory runs/clean/1"
    assert "warning" not in r.err


# -- resume ------------------------------------------------------------------------------------


def test_resume_refuses_code_that_is_gone_before_it_records_anything(tmp_path):
    plan = _plan(tmp_path, 'build: {out: net, target: "early_models:Net", width: 2}')
    (tmp_path / "plan.yaml").write_text((tmp_path / "plan.yaml").read_text().replace(
        "max_epochs: 2", "max_epochs: 1\ncheckpoint: {}"))
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    (tmp_path / "early_models.py").write_text(MODEL.replace("class Net(", "class Network("))
    before = _files(run)
    r = jobrun_proc("resume", run, "max_epochs=2")  # a process of its own: this one imported Net
    assert r.code == 2, r.err
    where = _at(tmp_path, '"early_models:Net"')
    assert r.err.splitlines()[0] == (f"{plan}:{where}: error: build: target 'early_models:Net' cannot be "
                                     "imported: 'early_models' has no attribute 'Net'")
    assert "did you mean 'Network'?" in r.err and "Traceback" not in r.err
    assert _files(run) == before


def test_resume_prints_the_warnings_its_overrides_bring_and_only_those(tmp_path, monkeypatch):
    # One epoch of a one-pass reader is fine; resumed to 3 epochs, epochs 2 and 3 would
    # read nothing. The plan's own warning (a blob never read) was shown by train already.
    plan = tmp_path / "plan.yaml"
    text = mlp_plan("more", "max_epochs: 1\ncheckpoint: {}", init=[LOSS]).replace("passes: 0", "passes: 1")
    plan.write_text(text.rstrip("\n") + "\n      - const: {out: spare, value: 1}\n")  # never read
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0 and r.err.count("warning:") == 1 and "'spare' is defined but never read" in r.err, r.err
    r = jobrun("resume", run, "max_epochs=3")
    assert r.code == 0, r.err
    warnings = [line for line in r.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "reader 'data' is made once, in init, with passes: 1" in warnings[0]
    assert "resuming with max_epochs: 1 -> 3" in r.err


@pytest.mark.slow
def test_under_torchrun_rank_0_refuses_for_every_rank_before_the_directory_is_made(tmp_path):
    plan = _plan(tmp_path, CASES["class-misspelt"][0])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "jobrun", "train", plan, "--run-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_S, cwd=tmp_path)
    assert p.returncode != 0
    # The first rank to stop prints it; torchrun then ends the other.
    assert f"{plan}:{_at(tmp_path, CASES['class-misspelt'][1])}: error: {CASES['class-misspelt'][2]}" in p.stderr
    # (torchrun's own ChildFailedError traceback follows: no frame of jobrun's.)
    assert "[rank0]: Traceback" not in p.stderr and "jobrun/" not in p.stderr.replace(plan, "")
    assert not (tmp_path / "run").exists()
