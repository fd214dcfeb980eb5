"""Sizes as the epoch lines and `ckpt list` print them."""

from __future__ import annotations

import time

import pytest

from jobrun.runner.display import human_count, human_size


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KB"), (5 * 2**20, "5.0 MB"),
    (3 * 2**30, "3.0 GB"), (5 * 2**40, "5.0 TB"), (3 * 2**50, "3072.0 TB"),
])
def test_human_size(n, text):
    assert human_size(n) == text


@pytest.mark.parametrize("x,text", [
    (107340.2, "107k"), (42817, "42.8k"), (1.2e6, "1.2M"), (1234567, "1.23M"), (3.071, "3.07"),
    (999.4, "999"), (999.7, "1k"), (1000, "1k"), (12.0, "12"), (0.5, "0.5"), (0, "0"), (2.5e9, "2.5G"),
])
def test_human_count_reads_as_people_write_rates(x, text):
    assert human_count(x) == text


# -- what a run prints ---------------------------------------------------------------------

import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from runner_util import HANG_S  # noqa: E402

from jobrun.runner.display import FOREVER, Display  # noqa: E402

COUNTER = """\
job: counter
max_epochs: 5
stop_when: [done]
checkpoint: {dir: ckpt}
init:
  - task: setup
    do: [{const: {out: n, value: 0}}]
epoch:
  - task: count
    do:
      - add: {in: [n, 1], out: n}
      - ge: {in: [n, 3], out: done}
      - log: {in: [n], msg: counted}
    outputs: [n, done]
exit:
  - task: bye
    do: [{log: {in: [n], msg: final}}]
"""


def _run(tmp_path, text: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    p = subprocess.run([sys.executable, "-m", "jobrun", "train", str(plan), "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=HANG_S, env={**os.environ, **env})
    return p, (tmp_path / "run" / "console.log").read_text()


@pytest.mark.slow
def test_piped_output_is_one_plain_line_per_epoch(tmp_path):
    p, log = _run(tmp_path, COUNTER)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split()[:2] for line in epochs] == [["epoch", "1/5"], ["epoch", "2/5"], ["epoch", "3/5"]]
    assert "n=1" in epochs[0] and "done" not in epochs[0]  # a false stop flag is noise
    assert "n=3 done=true" in epochs[2]
    assert not any(line.startswith("  [epoch") for line in lines)  # no second line per epoch
    assert "[exit bye] final: n=3" in lines  # logs outside epochs keep their own line
    assert "\x1b" not in p.stdout + p.stderr and "\r" not in p.stdout
    assert log.splitlines() == lines  # console.log holds what was printed


@pytest.mark.slow
def test_a_long_epoch_shows_life_in_a_log(tmp_path):
    slow = COUNTER.replace("      - add: {in: [n, 1], out: n}\n", (
        "      - add: {in: [n, 1], out: n}\n"
        "      - loop: 6\n"
        "        do: [{call: {fn: \"jobrun_test_helpers:sleep\", seconds: 0.25}}]\n"))
    p, log = _run(tmp_path, slow.replace("max_epochs: 5", "max_epochs: 1"), JOBRUN_PROGRESS_SECONDS="0.5")
    assert p.returncode == 0, p.stderr
    beats = [line for line in p.stdout.splitlines() if re.match(r"  epoch 1: step \d/6, [\d.]+ steps/s", line)]
    assert beats, p.stdout
    assert all(line in log for line in beats)


@pytest.mark.slow
def test_a_failure_is_in_console_log_too(tmp_path):
    p, log = _run(tmp_path, COUNTER.replace("      - log: {in: [n], msg: counted}\n",
                                            "      - call: {fn: \"jobrun_test_helpers:fail\"}\n"))
    assert p.returncode == 1
    assert "boom" in p.stderr and "boom" in log.splitlines()[-1]


def test_console_log_begins_with_what_train_said_before_the_run_started(tmp_path, monkeypatch):
    # README: "Everything printed is also in console.log"; the new run's directory and
    # analyze's warnings were printed before it existed, and were not in it.
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan.yaml"
    plan.write_text(COUNTER.replace("epoch:\n", "epoch:\n  - task: idle\n    do: [{const: {out: unread, value: 1}}]\n", 1))
    p = subprocess.run([sys.executable, "-m", "jobrun", "train", str(plan)], capture_output=True, text=True,
                       timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stderr.splitlines() if line.startswith(("run directory", "warning:", "  (`jobrun"))]
    assert said[-1] == "run directory runs/counter/1" and any("'unread'" in line for line in said), said
    log = (tmp_path / "runs/counter/1/console.log").read_text().splitlines()
    assert log[:len(said)] == said and log[len(said)].startswith("epoch 1/")


def test_console_log_has_what_resume_said_before_it_went_on(tmp_path):
    # README: what jobrun prints (warnings too) is also in console.log; a resume's skipped
    # epochs and overrides were printed before the run went on, and were not in it.
    from runner_util import jobrun

    plan, run = tmp_path / "plan.yaml", tmp_path / "run"
    plan.write_text(COUNTER)
    assert jobrun("train", plan, "--run-dir", run).code == 0
    (run / "ckpt" / "local.3" / "rank-0" / "COMMIT").unlink()
    r = jobrun("resume", run, "max_epochs=4")
    assert r.code == 0, r.text
    said = [line for line in (r.out + r.err).splitlines() if line.startswith(("warning:", "resuming with"))]
    assert len(said) == 2 and said[0].startswith("warning: skipping checkpoint epoch 3"), said
    log = (run / "console.log").read_text().splitlines()
    resumed = log.index("resumed from checkpoint epoch 2")
    assert set(said) <= set(log[:resumed]), log


@pytest.mark.slow
def test_console_log_has_what_a_resume_under_torchrun_said_before_it_went_on(tmp_path):
    # As the test above, the ranks started by torchrun: rank 0 printed the skipped epoch
    # and the override, and console.log did not have them.
    from runner_util import jobrun

    plan, run = tmp_path / "plan.yaml", tmp_path / "run"
    plan.write_text(COUNTER)
    assert jobrun("train", plan, "--run-dir", run).code == 0
    (run / "ckpt" / "local.3" / "rank-0" / "COMMIT").unlink()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        "-m", "jobrun", "resume", str(run), "max_epochs=4"], capture_output=True, text=True,
                       timeout=HANG_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    said = [line for line in p.stderr.splitlines() if line.startswith(("warning:", "resuming with"))]
    assert len(said) == 2 and said[0].startswith("warning: skipping checkpoint epoch 3"), said
    log = (run / "console.log").read_text().splitlines()
    resumed = log.index("resumed from checkpoint epoch 2")
    assert log[resumed - 2:resumed] == said, log


@pytest.mark.slow
def test_a_train_under_torchrun_says_the_plans_warnings_and_keeps_them_in_console_log(tmp_path):
    # A plain `jobrun train` printed analyze's warnings; under torchrun they were dropped.
    plan, run = tmp_path / "plan.yaml", tmp_path / "run"
    plan.write_text(COUNTER.replace("    do: [{log: {in: [n], msg: final}}]", "    do: []"))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        "-m", "jobrun", "train", str(plan), "--run-dir", str(run)], capture_output=True,
                       text=True, timeout=HANG_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    said = [line for line in p.stderr.splitlines() if "has no steps" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: {plan}:16:5: task 'bye'"), p.stderr
    assert said[0] in (run / "console.log").read_text().splitlines()


def test_console_log_has_the_epochs_a_restarted_rank_skipped(tmp_path, capsys):
    # A rank restarted by the elastic agent picks its epoch as resume does; the epochs it
    # skipped were printed and not in console.log.
    from runner_util import jobrun

    from jobrun.runner.rundir import RunDir
    from jobrun.runner.workers import Launch, _restarted

    plan, run = tmp_path / "plan.yaml", tmp_path / "run"
    plan.write_text(COUNTER)
    assert jobrun("train", plan, "--run-dir", run).code == 0
    (run / "ckpt" / "local.3" / "rank-0" / "COMMIT").unlink()
    before = (run / "console.log").read_text().splitlines()
    launch = _restarted(Launch(run, tmp_path, "cpu", None, 1), RunDir(run).plan(), 0, 1, 1)
    assert launch.resume_epoch == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and said[0].startswith("warning: skipping checkpoint epoch 3"), said
    assert (run / "console.log").read_text().splitlines() == [*before, *said]


def _start(d, key, i, n):
    """A loop at iteration i, as the executor writes it (the display's entry, and the
    epoch's loops by key)."""
    d.progress["loop"] = d.progress.setdefault("loops", {})[key] = _running(key, i, n)


def test_steps_per_epoch_are_known_from_the_second_epoch():
    d = Display(enabled=False, tty=False)
    d.status("epoch 1")
    for i in range(5):
        _start(d, "train/loop1", i, None)
        assert d._step() == (i + 1, None)  # the first epoch only counts
    _start(d, "train/loop2", 2, None)  # a second loop after it: an evaluation's
    d.status("epoch 2")
    _start(d, "train/loop1", 1, None)
    assert d._step() == (2, 5)  # each loop's own count
    _start(d, "train/loop2", 0, None)
    assert d._step() == (1, 3)
    _start(d, "train/loop3", 1, 9)  # a loop with a count knows it
    assert d._step() == (2, 9)


def test_steps_per_second_are_the_running_loops_since_it_started(capsys):
    # An inner loop that starts again is measured from its own start, not the epoch's.
    d = Display(enabled=True, tty=False, heartbeat=0.0)
    with d.live("j"):
        d.status("epoch 1")
        d._epoch_t0 -= 100  # the epoch ran 100 s before this loop began
        task, iterator, n, _ = _running("train", 9, 40)
        d.progress["loop"] = (task, iterator, n, time.perf_counter() - 0.1)  # 10 steps in 0.1 s
        d._refresh()
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "step 10/40" in x]
    rate = float(line.split("step 10/40, ")[1].split(" steps/s")[0])
    assert 10 < rate <= 100, line  # 10 in the loop's 0.1 s (and the test's), not in 100 s


def test_the_progress_bar_starts_over_when_another_loop_is_shown():
    class Bar:  # rich's Progress, as far as the display uses it
        def __init__(self):
            self.calls = []

        def reset(self, task, **kw):
            self.calls.append(("reset", kw))

        def update(self, task, **kw):
            self.calls.append(("update", kw["completed"]))

    d = Display(enabled=False, tty=False)
    d.status("epoch 1")
    d._progress_bar = bar = Bar()
    outer = _running("train", 1, 4)
    d.progress["loop"] = outer
    d._refresh()
    d._refresh()  # the same loop: no reset, its steps/s go on
    d.progress["loop"] = _running("train", 6, 32)  # an inner loop
    d._refresh()
    d.progress["loop"] = outer  # the inner loop ended: the outer one is shown again
    d._refresh()
    assert bar.calls == [("reset", {"total": 4, "completed": 2}), ("update", 2), ("update", 2),
                         ("reset", {"total": 32, "completed": 7}), ("update", 7),
                         ("reset", {"total": 4, "completed": 2}), ("update", 2)]


def test_summary_merges_outputs_and_logged_values_and_hides_false_flags(capsys):
    d = Display(enabled=True, tty=False)
    with d.live("j", frozenset({"done", "bored"})):
        d.status("epoch 4")
        d.logged("epoch", 4, "train", {"loss": 0.123456, "lr": 0.1}, None)
        d.epoch_line(SimpleNamespace(epoch=4, outputs={"train": {"loss": 0.1234, "done": False,
                                                                  "bored": True}},
                                     seconds=1.5, ckpt="ckpt 1 KB in 2 ms"), 10)
    out = capsys.readouterr().out
    assert out == "epoch 4/10  loss=0.1234 lr=0.1 bored=true  1.50s  ckpt 1 KB in 2 ms\n"


def test_a_null_value_shows_as_a_dash_as_everywhere_else_in_the_cli(capsys):
    """A validation every other epoch printed `val_loss=None` where `ckpt list` shows `-`."""
    d = Display(enabled=True, tty=False)
    with d.live("j"):
        d.status("epoch 2")
        d.logged("epoch", 2, "train", {"val_acc": None}, None)
        d.epoch_line(SimpleNamespace(epoch=2, outputs={"train": {"val_loss": None}}, seconds=1.0, ckpt=""), 3)
        d.logged("exit", 3, "report", {"best": None}, None)
    assert capsys.readouterr().out.splitlines() == ["epoch 2/3  val_acc=- val_loss=-  1.00s", "[exit report] best=-"]


def test_a_name_keeps_its_place_in_the_epoch_lines_whichever_log_ran_first(capsys):
    d = Display(enabled=True, tty=False)
    with d.live("j"):
        for epoch, logs in ((1, [{"loss": 0.5}, {"chunk": 3}]), (2, [{"chunk": 3}, {"loss": 0.25}]),
                            (3, [{"lr": 0.1}, {"chunk": 3}])):
            d.status(f"epoch {epoch}")
            for values in logs:  # e.g. a `log` with `every: 50` runs first in some epochs only
                d.logged("epoch", epoch, "train", values, None)
            d.epoch_line(SimpleNamespace(epoch=epoch, outputs={"train": {"acc": 0.9}}, seconds=1.0, ckpt=""), 3)
    assert capsys.readouterr().out.splitlines() == [
        "epoch 1/3  loss=0.5 chunk=3 acc=0.9  1.00s",
        "epoch 2/3  loss=0.25 chunk=3 acc=0.9  1.00s",
        "epoch 3/3  chunk=3 acc=0.9 lr=0.1  1.00s",  # a new name comes after the others
    ]


def test_under_max_steps_the_epoch_line_shows_the_global_step_and_readable_rates(capsys):
    d = Display(enabled=True, tty=False)
    result = SimpleNamespace(epoch=2, outputs={"train": {"loss": 2.5}}, seconds=2.0, ckpt="", step=200,
                             rates={"samples_per_s": 3350.0, "tokens_per_s": 107213.7, "data_s": 0.1})
    with d.live("gpt"):
        d.status("epoch 2")
        d.epoch_line(result, None, 300)
        d.epoch_line(result, 5, None)  # no max_steps: the epoch count is the progress
    assert capsys.readouterr().out.splitlines() == [
        "epoch 2  step 200/300  loss=2.5  2.00s  107k tokens/s  data 5%",
        "epoch 2/5  loss=2.5  2.00s  107k tokens/s  data 5%",
    ]


def _running(task, i, n):
    """The display's entry of a loop in its iteration i (0-based), as the executor's."""
    iterator = iter(FOREVER if n is None else range(n))
    for _ in range(i + 1):
        next(iterator)
    return task, iterator, n, time.perf_counter()


TWO_TASKS = """\
job: two
max_epochs: 3
loggers: [csv]
init:
  - task: setup
    do: [{const: {out: epoch_no, value: 0}}]
epoch:
  - task: train
    do:
      - const: {out: loss, value: 0.25}
      - log: {in: [loss]}
  - task: finetune
    do:
      - add: {in: [epoch_no, 1], out: epoch_no}
      - const: {out: loss, value: 0.5}
      - const: {out: acc, value: 0.75}
      - eq: {in: [epoch_no, 2], out: second}
      - if: second
        then: [{log: {in: [loss]}}]
    outputs: [acc]
"""


def test_a_name_two_epoch_tasks_give_is_shown_once_for_each_with_its_task(tmp_path):
    """The epoch line merged every task's values by name: finetune's loss hid train's
    (or the other way round, whichever thread logged last)."""
    import csv

    from runner_util import jobrun, logged

    plan = tmp_path / "plan.yaml"
    plan.write_text(TWO_TASKS)
    run = tmp_path / "run"
    r = jobrun("train", plan, "--run-dir", run)
    assert r.code == 0, r.text
    assert [line.split("  ")[:2] for line in r.out.splitlines() if line.startswith("epoch ")] == [
        ["epoch 1/3", "loss=0.25 acc=0.75"],  # one task gave it
        ["epoch 2/3", "train.loss=0.25 finetune.loss=0.5 acc=0.75"],  # in the plan's order of tasks
        ["epoch 3/3", "train.loss=0.25 acc=0.75"],  # named by task from then on
    ]
    # metrics.jsonl and the trackers keep both already, by task
    assert [(x["_epoch"], x["_task"], x["loss"]) for x in logged(run)
            if x["_epoch"] == 2] in ([(2, "train", 0.25), (2, "finetune", 0.5)],
                                     [(2, "finetune", 0.5), (2, "train", 0.25)])
    with open(run / "metrics.csv") as f:
        rows = {(row["epoch"], row["name"], row["value"]) for row in csv.DictReader(f)}
    assert {("2", "train/loss", "0.25"), ("2", "finetune/loss", "0.5")} <= rows, rows


def test_the_line_a_closed_output_refused_is_still_in_console_log(tmp_path, monkeypatch):
    """`jobrun train plan.yaml | head -1` stopped after epoch 2's checkpoint with epoch 2's
    line neither on the screen nor in console.log (written after the print that failed)."""
    from jobrun.runner import display

    class Closed(Exception):
        pass

    def closed() -> None:
        raise Closed

    def broken_pipe(*args, **kwargs) -> None:
        raise BrokenPipeError

    monkeypatch.setattr(display, "_stdout_closed", closed)
    monkeypatch.setattr(display, "print", broken_pipe, raising=False)
    log = tmp_path / "console.log"
    d = Display(enabled=True, tty=False, log=log)
    with pytest.raises(Closed), d.live("j"):
        d.line("epoch 2/8  loss=0.227")
    assert log.read_text().splitlines() == ["epoch 2/8  loss=0.227"]
