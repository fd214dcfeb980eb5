"""`jobrun plot`: logged values against epochs, one panel per metric, runs overlaid."""

from __future__ import annotations

import builtins
import json

import pytest
from runner_util import jobrun

from jobrun.errors import UsageError
from jobrun.runner.plot import plot, series
from jobrun.runner.rundir import RunDir

PLAN = """\
job: curve
max_epochs: 3
init:
  - task: setup
    do: [{const: {out: n, value: 0}}, {const: {out: x, value: 0}}]
epoch:
  - task: t
    do:
      - add: {in: [n, 1], out: n}
      - loop: 2
        do:
          - add: {in: [x, 10], out: x}
          - log: {in: [x]}
      - log: {in: [n], msg: per-epoch}
"""


def _metrics(tmp_path, records) -> RunDir:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"job": "j"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"cut')
    return RunDir(run)


def test_series_places_values_on_the_epoch_axis(tmp_path):
    run = _metrics(tmp_path, [
        {"epoch": 0, "group": "init", "values": {"loss": 9.0}},  # not an epoch: no point
        {"epoch": 1, "group": "epoch", "task": "t", "values": {"loss": 1.0, "name": "a", "flag": True}},
        {"epoch": 2, "group": "epoch", "task": "t", "values": {"loss": 0.5}},
        {"epoch": 2, "group": "epoch", "task": "t", "values": {"loss": 0.25}},
        {"epoch": 2, "event": "checkpoint_save", "seconds": 0.1},
        {"epoch": 3, "group": "epoch", "task": "t", "values": {"loss": "nan"}},
    ])
    assert series(run) == {"loss": [(1.0, 1.0), (1.5, 0.5), (2.0, 0.25)]}


def test_series_takes_epoch_outputs_not_also_logged(tmp_path):
    run = _metrics(tmp_path, [
        {"epoch": 1, "group": "epoch", "task": "t", "values": {"loss": 1.0}},
        {"epoch": 1, "event": "epoch", "outputs": {"t": {"loss": 1.0, "val": 0.5, "done": False}}},
        {"epoch": 2, "event": "epoch", "outputs": {"t": {"loss": 0.8, "val": 0.4, "done": True}}},
    ])
    assert series(run) == {"loss": [(1.0, 1.0), (2.0, 0.8)], "val": [(1.0, 0.5), (2.0, 0.4)]}


def test_series_of_a_name_two_tasks_give_is_a_line_for_each_as_the_epoch_line_names_them(tmp_path):
    """train's and finetune's `loss` were one line, the two tasks' points interleaved."""
    run = _metrics(tmp_path, [
        {"epoch": 1, "group": "epoch", "task": "train", "values": {"loss": 1.0, "lr": 0.1}},
        {"epoch": 1, "group": "epoch", "task": "finetune", "values": {"loss": 5.0}},
        {"epoch": 1, "event": "epoch", "outputs": {"train": {"loss": 1.0}, "finetune": {"loss": 5.0, "acc": 0.5}}},
        {"epoch": 2, "group": "epoch", "task": "train", "values": {"loss": 0.5, "lr": 0.05}},
        {"epoch": 2, "event": "epoch", "outputs": {"train": {"loss": 0.5}, "finetune": {"loss": 4.0, "acc": 0.6}}},
    ])
    assert series(run) == {"train.loss": [(1.0, 1.0), (2.0, 0.5)], "finetune.loss": [(1.0, 5.0), (2.0, 4.0)],
                           "lr": [(1.0, 0.1), (2.0, 0.05)], "acc": [(1.0, 0.5), (2.0, 0.6)]}
    with pytest.raises(UsageError, match="no metric 'loss' was logged") as e:
        plot([str(run.path)], None, ("loss",))
    assert e.value.hint == "each task gives its own: finetune.loss, train.loss"


def test_series_on_the_step_axis_takes_each_records_step(tmp_path):
    run = _metrics(tmp_path, [
        {"epoch": 1, "group": "epoch", "task": "t", "step": 5, "values": {"loss": 1.0}},
        {"epoch": 1, "group": "epoch", "task": "t", "step": 10, "values": {"loss": 0.5}},
        {"epoch": 1, "event": "epoch", "outputs": {"t": {"loss": 0.5, "val": 0.7}}},
        {"epoch": 2, "group": "epoch", "task": "t", "step": 20, "values": {"loss": 0.25}},
        {"epoch": 2, "event": "epoch", "outputs": {"t": {"val": 0.6}}},
        {"epoch": 3, "event": "epoch", "outputs": {"t": {"val": 0.1}}},  # no step logged: no point
    ])
    assert series(run, "step") == {"loss": [(5.0, 1.0), (10.0, 0.5), (20.0, 0.25)],
                                   "val": [(10.0, 0.7), (20.0, 0.6)]}


def test_plot_of_one_metric_of_several_runs_against_steps(two_runs, tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = {}
    real = matplotlib.figure.Figure.savefig

    def capture(fig, path, **kw):
        for ax in fig.axes:
            if ax.get_visible():
                drawn[ax.get_title()] = (ax.get_xlabel(), {line.get_label(): list(line.get_xdata())
                                                           for line in ax.lines})
        return real(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    r = jobrun("plot", *two_runs, "--metric", "x", "--x", "step", "-o", tmp_path / "x.png")
    assert r.code == 0, r.text
    # `log` inside the loop: its steps are the ones metrics.jsonl holds (1, 2, 3... here).
    steps = {name: [float(m["step"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                    if m.get("values", {}).get("x") is not None]
             for name, run in zip("ab", two_runs)}
    assert drawn == {"x": ("step", steps)} and len(steps["a"]) == 6 and len(steps["b"]) == 4
    bad = jobrun("plot", *two_runs, "--x", "time")
    assert bad.code == 2 and "'time' is not one of 'auto', 'step', 'epoch'" in bad.err


@pytest.fixture
def two_runs(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    for name, extra in (("a", ()), ("b", ("max_epochs=2",))):
        assert jobrun("train", plan, "--run-dir", tmp_path / name, *extra).code == 0
    return tmp_path / "a", tmp_path / "b"


def test_plot_draws_every_metric_of_every_run(two_runs, tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = {}
    real = matplotlib.figure.Figure.savefig

    def capture(fig, path, **kw):
        for ax in fig.axes:
            if ax.get_visible():
                drawn[ax.get_title()] = {line.get_label(): list(line.get_xdata()) for line in ax.lines}
        return real(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    out = tmp_path / "both.png"
    r = jobrun("plot", *two_runs, "-o", out)
    assert r.code == 0, r.text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == {"n": {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.0]},
                     "x": {"a": [0.5, 1.0, 1.5, 2.0, 2.5, 3.0], "b": [0.5, 1.0, 1.5, 2.0]}}


def test_plot_of_one_run_defaults_into_the_run_dir(two_runs):
    r = jobrun("plot", two_runs[0], "--metric", "n")
    assert r.code == 0, r.text
    assert (two_runs[0] / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_metric_is_one_message(two_runs):
    r = jobrun("plot", two_runs[0], "--metric", "nn")
    assert r.code == 2 and "no metric 'nn'" in r.err and "did you mean 'n'" in r.err


def test_without_matplotlib_the_message_names_the_extra(two_runs, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    r = jobrun("plot", two_runs[0])
    assert r.code == 2 and 'pip install "jobrun[plot]"' in r.err
    assert "Traceback" not in r.text


def test_not_a_run_is_one_message(tmp_path):
    r = jobrun("plot", tmp_path)
    assert r.code == 2 and "not a jobrun run directory" in r.err


def test_log_every_k_logs_at_global_steps_0_k_2k_across_epochs_and_resumes(tmp_path):
    text = """\
job: every
max_epochs: 3
checkpoint: {dir: ckpt}
init:
  - task: setup
    do:
      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}
      - model.mlp: {out: model, sizes: [2, 1]}
      - optimizer: {in: model, out: opt, lr: 0.01}
      - const: {out: n, value: 0}
epoch:
  - task: t
    do:
      - loop: 5
        do:
          - train.step: {in: [model, opt, x, y], out: loss, loss: mse}
          - add: {in: [n, 1], out: n}
          - log: {in: [n], every: 2}
"""
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logs = [(r["epoch"], r["step"], r["values"]["n"]) for r in records if "values" in r]
    # at global steps 0, 2, 4, ... as each iteration began (its train.step is the n-th step)
    assert logs == [(1, 0, 1), (1, 2, 3), (1, 4, 5), (2, 6, 7), (2, 8, 9), (3, 10, 11), (3, 12, 13),
                    (3, 14, 15)]
    assert [r["step"] for r in records if r.get("event") == "epoch"] == [5, 10, 15]
    s = series(RunDir(run))
    assert s.axis == "step"
    assert s["n"] == [(float(step), float(n)) for _, step, n in logs]
    # TensorBoard gets the same points, at the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("t/n")] == [(s, float(x)) for _, s, x in logs]
    # a resume from epoch 1 counts on from the checkpoint: the same points
    assert jobrun("resume", "--run-dir", run, "--epoch", "1").code == 0
    again = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"], r["values"]["n"]) for r in again if "values" in r] == logs


def test_every_runs_once_per_step_in_a_loop_that_takes_none(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("job: j\nmax_epochs: 2\nepoch:\n  - task: t\n    do:\n      - loop: 4\n        as: i\n"
                    "        do: [{log: {in: [i], every: 3}}]\n")
    run = tmp_path / "run"
    assert jobrun("train", plan, "--run-dir", run).code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the global step stays 0: the step runs once (at step 0), not at every iteration
    assert [(r["epoch"], r["step"], r["values"]) for r in records if "values" in r] == [(1, 0, {"i": 0})]


@pytest.mark.parametrize("every", ["0", "2.5", "true"])
def test_every_must_be_a_count(tmp_path, every):
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"job: j\nmax_epochs: 1\nepoch:\n  - task: t\n    do: [{{log: {{every: {every}}}}}]\n")
    r = jobrun("train", plan, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "plan.yaml:5:" in r.err and "every" in r.err
    assert not (tmp_path / "run").exists()
