"""`early_stop` and `checkpoint.best`: Lightning's meaning, checkpointed, printed, checked.

The plans here need no model: the monitored value is computed from the epoch number, so
every run's sequence of values, and so where it stops, is known in advance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from runner_util import jobrun, logged

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.analyze import analyze
from jobrun.plans.compile import compile_text
from jobrun.runner.monitor import EarlyStopping
from jobrun.store import list_checkpoints, prune

# val_loss after epoch e is (e - 3)^2: 4, 1, 0, 1, 4, 9, ... (best at epoch 3).
PLAN = """\
job: es
max_epochs: 20
early_stop: {monitor: val_loss, mode: min, patience: 2}
checkpoint: {dir: ckpt, keep: 1, best: {monitor: val_loss, mode: min, keep: 1}}
init:
  - task: setup
    do:
      - const: {out: e, value: 0}
      - fill: {out: w, shape: [4, 16], value: 1.0}
epoch:
  - task: train
    do:
      - add: {in: [e, 1], out: e}
      - sub: {in: [e, 3], out: d}
      - mul: {in: [d, d], out: val_loss}
      - mul: {in: [w, 2.0], out: w}
      - log: {in: [e, val_loss]}
    outputs: [val_loss]
"""


def spec(patience: int = 3, min_delta: float = 0.0, mode: str = "min") -> ir.EarlyStop:
    return ir.EarlyStop(ir.Monitor(ir.BlobRef("val_loss", Pos("p")), mode), patience, min_delta)


def stops_after(values: list[float], **kwargs) -> int | None:
    """The epoch (1-based) after which early stopping stops the job, or None."""
    early = EarlyStopping(spec(**kwargs))
    for epoch, value in enumerate(values, 1):
        early.update(value, epoch)
        if early.reason() is not None:
            return epoch
    return None


@pytest.mark.parametrize(
    ("values", "kwargs", "epoch"),
    [
        ([4, 1, 0, 1, 4, 9], {"patience": 2}, 5),  # two epochs in a row without improvement
        ([4, 1, 0, 1, 0, 1, 2], {"patience": 2}, 5),  # an equal value is no improvement
        ([4, 1, 2, 0.5, 3, 3, 3], {"patience": 3}, 7),  # an improvement resets the count
        ([1.0, 0.97, 0.96, 0.9], {"patience": 2, "min_delta": 0.05}, 3),  # better by no more than 0.05
        ([1.0, 0.9, 0.8, 0.7], {"patience": 1, "min_delta": 0.05}, None),
        ([0.1, 0.5, 0.4, 0.45], {"patience": 2, "mode": "max"}, 4),
        # patience 0 stops at the first epoch without improvement, as 1 does
        ([1, 0.5, 0.7], {"patience": 0}, 3),
        ([1, 0.5, 0.7], {"patience": 1}, 3),
        ([1, math.nan], {"patience": 5}, 2),  # a value that is not finite stops at once
        ([1, math.inf], {"patience": 5}, 2),
    ],
)
def test_lightnings_rule(values: list[float], kwargs: dict, epoch: int | None) -> None:
    assert stops_after(values, **kwargs) == epoch


def test_the_state_survives_a_round_trip_through_json() -> None:
    early = EarlyStopping(spec(patience=3))
    for epoch, value in enumerate([3.0, 1.0 / 3.0, 2.0], 1):
        early.update(value, epoch)
    state = json.loads(json.dumps(early.state(), allow_nan=False))
    back, note = EarlyStopping.restored(spec(patience=3), state)
    assert note is None and back == early and back.best == 1.0 / 3.0  # exactly
    other, note = EarlyStopping.restored(spec(patience=3, mode="max"), state)
    assert other == EarlyStopping(spec(patience=3, mode="max")) and "starts counting again" in note
    nan = EarlyStopping(spec())
    nan.update(math.nan, 4)
    back, _ = EarlyStopping.restored(spec(), json.loads(json.dumps(nan.state(), allow_nan=False)))
    assert "val_loss is nan after epoch 4" in back.reason()


# -- a run ---------------------------------------------------------------------------------


def epochs_run(run: Path) -> list[int]:
    return [v["e"] for v in logged(run)]


def test_a_run_stops_early_and_says_why(plan_file, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = jobrun("train", plan_file(PLAN), "--run-dir", run)
    assert r.code == 0, r.text
    assert epochs_run(run) == [1, 2, 3, 4, 5]
    line = "stopping early after epoch 5: no better val_loss than 0 (epoch 3) for 2 epochs"
    assert line in r.out and line in (run / "console.log").read_text()
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["last_epoch"] == 5
    # resumed as it is, it says how to go on: `max_epochs=N` would stop again at once
    r = jobrun("resume", "--run-dir", run)
    assert r.code == 0 and "already finished at epoch 5, stopped early: no better val_loss" in r.out, r.text
    assert f"`jobrun resume {run} early_stop.patience=N`" in r.out and "max_epochs=N" not in r.out


@pytest.mark.parametrize("first", [["max_epochs=4"], ["max_epochs=2"]])
def test_resume_keeps_counting(plan_file, tmp_path: Path, first: list[str]) -> None:
    # Were the count lost, epoch 5 (val_loss 4) would be a new best and the job would
    # go on to epoch 7.
    run = tmp_path / "run"
    path = plan_file(PLAN)
    assert jobrun("train", path, "--run-dir", run, *first).code == 0
    r = jobrun("resume", "--run-dir", run, "max_epochs=20")
    assert r.code == 0, r.text
    assert epochs_run(run) == [1, 2, 3, 4, 5]
    assert "stopping early after epoch 5" in r.out


def test_resume_from_an_earlier_epoch_counts_from_there(plan_file, tmp_path: Path) -> None:
    run = tmp_path / "run"
    path = plan_file(PLAN.replace("keep: 1, best", "keep: null, best"))
    assert jobrun("train", path, "--run-dir", run).code == 0
    r = jobrun("resume", "--run-dir", run, "--epoch", "4")
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 4" in r.out and "stopping early after epoch 5" in r.out
    # A finished run told to go on stops again at once, saying why.
    r = jobrun("resume", "--run-dir", run, "max_epochs=30")
    assert r.code == 0, r.text
    assert "stopping early (as after epoch 5): no better val_loss than 0 (epoch 3) for 2 epochs" in r.out
    assert epochs_run(run) == [1, 2, 3, 4, 5]
    # ... unless the change lets it: with more patience it goes on from epoch 5's count,
    # as a run trained with that patience from the start (no warning that it is not)
    r = jobrun("resume", "--run-dir", run, "early_stop.patience=4")
    assert r.code == 0, r.text
    assert epochs_run(run) == [1, 2, 3, 4, 5, 6, 7]
    assert "resuming with early_stop.patience: 2 -> 4" in r.text and "warning" not in r.text, r.text


def test_a_monitored_value_that_is_no_number_is_one_clear_error(plan_file, tmp_path: Path) -> None:
    text = PLAN.replace("      - log: {in: [e, val_loss]}\n", "      - fill: {out: val_loss, shape: [2], value: 1.0}\n")
    r = jobrun("train", plan_file(text), "--run-dir", tmp_path / "run")
    assert r.code == 1 and "Traceback" not in r.text
    assert f"{tmp_path / 'plan.yaml'}:3:23: error: early_stop monitors 'val_loss', which holds a Tensor " \
        "of shape [2] after epoch 1, not a number" in r.err
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


# Validation every other epoch (Lightning's check_val_every_n_epoch=2): null on odd epochs,
# (e - 6)^2 on even ones: 16, 4, 0, 4, 16 at epochs 2, 4, 6, 8, 10 (best at epoch 6).
EVERY_OTHER = PLAN.replace("      - const: {out: e, value: 0}\n", "      - const: {out: e, value: 0}\n"
                           "      - const: {out: measure, value: true}\n").replace(
    """      - sub: {in: [e, 3], out: d}
      - mul: {in: [d, d], out: val_loss}
""", """      - not: {in: measure, out: measure}
      - if: measure
        then:
          - sub: {in: [e, 6], out: d}
          - mul: {in: [d, d], out: val_loss}
        else:
          - const: {out: val_loss, value: null}
""")


def test_a_null_value_is_an_epoch_that_did_not_measure_it(plan_file, tmp_path: Path) -> None:
    """early_stop counts, and checkpoint.best ranks, only the epochs that measured the
    value, as Lightning's callbacks see only the epochs that validated."""
    assert stops_after([None, 4, None, 1, None, 3, None], patience=2) is None
    assert stops_after([None, 4, None, 1, None, 3, None, 2], patience=2) == 8
    run = tmp_path / "run"
    r = jobrun("train", plan_file(EVERY_OTHER), "--run-dir", run)
    assert r.code == 0, r.text
    assert epochs_run(run) == list(range(1, 11))
    assert ("stopping early after epoch 10: no better val_loss than 0 (epoch 6) in the 2 epochs that "
            "measured it (of 4 since)") in r.out
    kept = {info.epoch: info.nodes["local"].meta["best"]["value"] for info in list_checkpoints(run / "ckpt")}
    assert kept == {6: 0, 10: 16}
    r = jobrun("ckpt", "show", str(run), "--epoch", "best")
    assert r.code == 0 and "epoch 6" in r.out, r.text


# -- the plan side -------------------------------------------------------------------------


def test_print_shows_when_it_stops(plan_file) -> None:
    r = jobrun("print", plan_file(PLAN))
    assert r.code == 0
    assert "epoch (repeat until no better val_loss for 2 epochs or epoch 20):" in r.out
    assert 'early_stop: {monitor: "val_loss", mode: "min", patience: 2, min_delta: 0.0}' in r.out
    assert 'best: {monitor: "val_loss", mode: "min", keep: 1}' in r.out


def test_early_stop_alone_is_a_stop_condition() -> None:
    diags = analyze(compile_text(PLAN.replace("max_epochs: 20\n", ""), "p.yaml"))
    assert [d for d in diags if d.severity == "error"] == []


@pytest.mark.parametrize(
    ("old", "new", "where", "words"),
    [
        ("early_stop: {monitor: val_loss,", "early_stop: {monitor: val_los,", (3, 23),
         ("early_stop monitors 'val_los', which is not an output of any epoch task", "did you mean 'val_loss'?")),
        ("best: {monitor: val_loss,", "best: {monitor: e,", (4, 50),
         ("checkpoint.best monitors 'e'", "add 'e' to the `outputs`")),
    ],
)
def test_analyze_checks_the_monitored_name(old: str, new: str, where: tuple[int, int], words: tuple) -> None:
    diags = analyze(compile_text(PLAN.replace(old, new), "p.yaml"))
    errors = [d for d in diags if d.severity == "error"]
    assert len(errors) == 1 and errors[0].code == "monitor", diags
    assert (errors[0].pos.line, errors[0].pos.col) == where
    text = errors[0].format()
    assert all(w in text for w in words), text


def test_analyze_warns_when_early_stop_and_best_rank_one_value_in_opposite_modes() -> None:
    """early_stop `mode: max` on val_loss beside checkpoint.best's `min` ran without a word:
    the job stopped once val_loss had fallen for `patience` epochs."""
    diags = analyze(compile_text(PLAN.replace("val_loss, mode: min, patience", "val_loss, mode: max, patience"),
                                 "p.yaml"))
    warned = [d for d in diags if d.code == "monitor-mode"]
    assert len(warned) == 1 and warned[0].severity == "warning" and warned[0].pos.line == 3, diags
    text = warned[0].format()
    assert "early_stop takes a higher val_loss as better (mode: max), checkpoint.best a lower one (mode: min)" in text
    assert "give both the same `mode`" in text
    assert not [d for d in analyze(compile_text(PLAN, "p.yaml")) if d.code == "monitor-mode"]


def test_analyze_warns_that_an_accuracy_under_mse_never_counts() -> None:
    """early_stop on evaluate's accuracy with `loss: mse` (null in every epoch: the labels
    are no classes) never stopped the job, and said nothing."""
    text = PLAN.replace("      - mul: {in: [d, d], out: val_loss}\n", "").replace(
        "      - fill: {out: w, shape: [4, 16], value: 1.0}\n",
        "      - fill: {out: w, shape: [4, 16], value: 1.0}\n"
        "      - data.synthetic: {out: [x, y], task: regression, n: 8, features: 2}\n"
        "      - reader: {in: [x, y], out: val}\n      - model.mlp: {out: model, sizes: [2, 1]}\n").replace(
        "      - log: {in: [e, val_loss]}\n",
        "      - evaluate: {in: [model, val], out: [loss, val_loss], loss: mse}\n      - log: {in: [e, loss]}\n")
    diags = analyze(compile_text(text, "p.yaml"))
    warned = [d for d in diags if d.code == "monitor-null"]
    assert [(d.severity, d.pos.line) for d in warned] == [("warning", 3), ("warning", 4)], diags
    text = warned[0].format()
    assert "early_stop monitors 'val_loss', the accuracy of an evaluate with loss: mse" in text, text
    assert "null in every epoch" in text and "monitor its loss" in text
    assert not [d for d in analyze(compile_text(PLAN, "p.yaml")) if d.code == "monitor-null"]


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        ("mode: min, patience: 2}", "mode: up, patience: 2}", "early_stop.mode must be min or max"),
        ("patience: 2}", "patience: 2, min_delta: -0.1}", "min_delta must be a number >= 0"),
        ("patience: 2}", "patience: -1}", "early_stop.patience is -1"),
        ("{monitor: val_loss, mode: min, patience: 2}", "{patience: 2}", "early_stop has no `monitor`"),
        ("patience: 2}", "patiance: 2}", "unknown key 'patiance' in early_stop"),
        ("keep: 1}}", "keep: 0}}", "checkpoint.best.keep is 0"),
    ],
)
def test_bad_settings_are_refused_with_their_place(plan_file, old: str, new: str, words: str) -> None:
    path = plan_file(PLAN.replace(old, new, 1))
    r = jobrun("analyze", path)
    assert r.code == 2 and words in r.err and f"{path}:" in r.err, r.text


# -- best checkpoints ----------------------------------------------------------------------


@pytest.fixture
def best_run(plan_file, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    r = jobrun("train", plan_file(PLAN.replace("patience: 2", "patience: 3")), "--run-dir", run)
    assert r.code == 0, r.text
    assert epochs_run(run) == [1, 2, 3, 4, 5, 6]
    return run


def test_pruning_keeps_the_best_epoch_beside_the_newest(best_run: Path) -> None:
    assert [i.epoch for i in list_checkpoints(best_run / "ckpt")] == [3, 6]
    meta = list_checkpoints(best_run / "ckpt")[0].nodes["local"].meta
    assert meta["best"] == {"monitor": "val_loss", "mode": "min", "value": 0.0}
    assert meta["early_stop"]["best_epoch"] == 3


def test_ckpt_list_shows_the_values_and_marks_the_best(best_run: Path) -> None:
    r = jobrun("ckpt", "list", best_run)
    lines = r.out.splitlines()
    assert "val_loss" in lines[0] and len(lines) == 3
    assert lines[1].split()[0] == "3" and lines[1].endswith("0  ok, best val_loss (min)")
    assert lines[2].split()[0] == "6" and lines[2].endswith("9  ok")
    rows = json.loads(jobrun("ckpt", "list", best_run, "--json").out)["checkpoints"]
    assert [(r["epoch"], r["monitor"], r["value"], r["best"]) for r in rows] == [
        (3, "val_loss", 0.0, True), (6, "val_loss", 9.0, False)]


def test_ckpt_show_gives_the_early_stop_state_a_resume_counts_on(best_run: Path) -> None:
    """The best value, its epoch and the epochs waited were only in the checkpoint meta."""
    r = jobrun("ckpt", "show", best_run)
    assert r.code == 0 and r.out.splitlines()[:3] == [
        "epoch 6", "early_stop: val_loss (min) best 0 (epoch 3), 3/3 epochs without improvement", "node local:"]
    shown = json.loads(jobrun("ckpt", "show", best_run, "--epoch", "3", "--json").out)["early_stop"]
    assert {k: shown[k] for k in ("monitor", "best", "best_epoch", "wait", "patience", "note")} == {
        "monitor": "val_loss", "best": 0.0, "best_epoch": 3, "wait": 0, "patience": 3, "note": None}


def test_export_best_and_resume_from_the_best(best_run: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out = tmp_path / "w.safetensors"
    r = jobrun("export", best_run, "--best", "--blob", "w", "-o", out)
    assert r.code == 0, r.text
    assert load_file(out)["w"][0, 0] == 2.0**3  # doubled every epoch: epoch 3's
    r = jobrun("ckpt", "show", best_run, "--epoch", "best", "--blob", "e")
    assert "epoch 3" in r.out and "e = 3" in r.out
    r = jobrun("resume", "--run-dir", best_run, "--epoch", "best")
    assert r.code == 0, r.text
    assert "resumed from checkpoint epoch 3" in r.out
    assert epochs_run(best_run) == [1, 2, 3, 4, 5, 6]  # the same epochs again, from 3


def test_best_needs_checkpoint_best_in_the_plan(plan_file, tmp_path: Path) -> None:
    run = tmp_path / "run"
    text = PLAN.replace(", best: {monitor: val_loss, mode: min, keep: 1}", "")
    assert jobrun("train", plan_file(text), "--run-dir", run).code == 0
    r = jobrun("export", run, "--best", "--blob", "w", "-o", tmp_path / "w.safetensors")
    assert r.code == 2 and "has no `checkpoint.best`" in r.err and "--epoch E" in r.err
    r = jobrun("resume", "--run-dir", run, "--epoch", "best")
    assert r.code == 2 and "has no `checkpoint.best`" in r.err
    assert jobrun("resume", "--run-dir", run, "--epoch", "bets").code == 2


def test_prune_never_deletes_a_protected_epoch(tmp_path: Path) -> None:
    from jobrun.store import save

    for epoch in range(6):
        save({"x": epoch}, {"epoch": epoch}, tmp_path, "local", epoch)
    assert prune(tmp_path, 2, ["local"], protect=[1, 3]) == [0, 2]
    assert [i.epoch for i in list_checkpoints(tmp_path)] == [1, 3, 4, 5]
