"""`loggers: [csv, mlflow, wandb]`: what a run logs, read back from each tracker's store."""

from __future__ import annotations

import csv
import json

import pytest
from jobrun_test_helpers import mlp_plan
from runner_util import jobrun, metrics

from jobrun.plans.compile import compile_text

PLAN = mlp_plan("tracked", "max_epochs: 3\nvars: {lr: 0.1, hidden: 8}\ncheckpoint: {dir: ckpt}\n"
                "loggers: [LOGGERS]", batch=16, hidden='"${hidden}"', lr='"${lr}"',
                init=["const: {out: loss, value: 0.0}"], step=["log: {in: [loss], every: 2}"],
                epoch=["evaluate: {in: [model, data], out: [val_loss, accuracy]}"], outputs="[loss, val_loss, accuracy]")


def _train(plan_file, tmp_path, loggers: str, *extra: str):
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(PLAN.replace("LOGGERS", loggers)), "--run-dir", run_dir,
               "vars.lr=0.05", *extra)
    assert r.code == 0, r.text
    return run_dir


def _logged_steps(run_dir) -> list[tuple[int, int, float]]:
    """(epoch, step, loss) of every `log` record in metrics.jsonl: what trackers must hold."""
    return [(m["epoch"], m["step"], m["values"]["loss"]) for m in metrics(run_dir) if "values" in m]


# -- the plan key ---------------------------------------------------------------------------


def test_loggers_key_is_checked_with_did_you_mean():
    assert compile_text(PLAN.replace("LOGGERS", "csv, mlflow")).loggers == ("csv", "mlflow")
    assert compile_text(PLAN.replace("loggers: [LOGGERS]\n", "")).loggers == ()
    from jobrun.errors import PlanError

    with pytest.raises(PlanError) as e:
        compile_text(PLAN.replace("LOGGERS", "csv, mlflw"))
    assert "unknown logger 'mlflw'" in e.value.message and "mlflow" in (e.value.hint or "")
    assert e.value.pos.line == PLAN.splitlines().index("loggers: [LOGGERS]") + 1  # the loggers line
    with pytest.raises(PlanError, match="named twice"):
        compile_text(PLAN.replace("LOGGERS", "csv, csv"))


def test_print_shows_the_loggers(plan_file):
    r = jobrun("print", plan_file(PLAN.replace("LOGGERS", "mlflow, csv")))
    assert r.code == 0 and "loggers: [mlflow, csv]" in r.out.splitlines()


def test_analyze_reports_an_unknown_logger(plan_file):
    r = jobrun("analyze", plan_file(PLAN.replace("LOGGERS", "wandbb")))
    assert r.code != 0 and "unknown logger 'wandbb'" in r.text and "wandb" in r.text


def test_schema_lists_the_loggers():
    from jobrun.plans.schema import plan_schema

    spec = plan_schema()["properties"]["loggers"]
    assert {"enum": ["csv", "mlflow", "wandb"]} in spec["anyOf"]


# -- csv ------------------------------------------------------------------------------------


def _csv(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_csv_holds_the_logged_values_and_epoch_outputs_on_the_metrics_steps(plan_file, tmp_path):
    run_dir = _train(plan_file, tmp_path, "csv")
    rows = _csv(run_dir)
    loss = [(int(r["epoch"]), int(r["step"]), float(r["value"])) for r in rows if r["name"] == "train/loss"]
    assert loss == _logged_steps(run_dir) and len(loss) == 6  # 4 steps an epoch, every 2nd
    acc = [r for r in rows if r["name"] == "epoch/train/accuracy"]
    epochs = {m["epoch"]: m for m in metrics(run_dir) if m.get("event") == "epoch"}
    assert [int(r["epoch"]) for r in acc] == [1, 2, 3]
    for r in acc:  # at the epoch's last logged step
        assert float(r["value"]) == epochs[int(r["epoch"])]["outputs"]["train"]["accuracy"]
        assert int(r["step"]) == max(s for e, s, _ in loss if e == int(r["epoch"]))
    assert {r["name"] for r in rows} >= {"system/samples_per_s", "system/peak_memory_bytes", "epoch"}
    # the epoch's mean loss, a 0-d tensor until something reads it, is sent as a number too
    mean = {int(r["epoch"]): float(r["value"]) for r in rows if r["name"] == "epoch/train/loss"}
    assert list(mean) == [1, 2, 3]
    assert all(mean[e] == pytest.approx(epochs[e]["outputs"]["train"]["loss"], rel=1e-5) for e in mean)
    assert json.loads((run_dir / "trackers.json").read_text()) == {"csv": "metrics.csv"}


def test_csv_resume_drops_the_epochs_after_the_checkpoint(plan_file, tmp_path):
    run_dir = _train(plan_file, tmp_path, "csv")
    r = jobrun("resume", "--run-dir", run_dir, "--epoch", "1", "max_epochs=2")
    assert r.code == 0, r.text
    loss = [(int(r["epoch"]), int(r["step"]), float(r["value"]))
            for r in _csv(run_dir) if r["name"] == "train/loss"]
    assert loss == _logged_steps(run_dir) and [e for e, _, _ in loss] == [1, 1, 2, 2]


def test_csv_rows_are_written_as_values_come_not_after_the_flush_period(tmp_path):
    # They waited up to FLUSH_S (5 s) in the trackers' thread: a kill -9 lost them, and a
    # resume from a later checkpoint left metrics.csv without the epochs before it.
    from jobrun.runner.trackers import Trackers

    trackers = Trackers(("csv",), tmp_path, "job", None, {}, warn=lambda text: None)
    trackers.log("train", 3, {"loss": 0.5})
    trackers.epoch(1, {"train": {"acc": 0.75}}, {})
    rows = [(r["epoch"], r["step"], r["name"], r["value"]) for r in _csv(tmp_path)]
    assert rows == [("1", "3", "train/loss", "0.5"), ("1", "3", "epoch/train/acc", "0.75"),
                    ("1", "3", "epoch", "1.0")]
    trackers.finish("finished", {})
    assert len(_csv(tmp_path)) == 3


# -- MLflow ---------------------------------------------------------------------------------


def test_mlflow_run_holds_metrics_params_and_the_model_and_resume_continues_it(plan_file, tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    run_dir = _train(plan_file, tmp_path, "mlflow", "max_epochs=2")
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"vars.lr": "0.05", "vars.hidden": "8", "overrides": "vars.lr=0.05 max_epochs=2",
                               "job": "tracked"}
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert history == sorted((s, v) for _, s, v in _logged_steps(run_dir))
    acc = client.get_metric_history(run_id, "epoch/train/accuracy")
    assert len(acc) == 2
    (art,) = client.list_artifacts(run_id, "model")
    assert art.path == "model/model.safetensors"
    local = client.download_artifacts(run_id, art.path, str(tmp_path))
    from safetensors.torch import load_file

    assert set(load_file(local)) == {"0.weight", "0.bias", "2.weight", "2.bias"}

    r = jobrun("resume", "--run-dir", run_dir, "max_epochs=3")
    assert r.code == 0, r.text
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run_id
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the same run, continued
    assert len(client.get_metric_history(run_id, "epoch/train/accuracy")) == 3
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_missing_tracker_package_is_one_clear_error(plan_file, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, to importlib
    r = jobrun("train", plan_file(PLAN.replace("LOGGERS", "wandb")), "--run-dir", tmp_path / "run")
    assert r.code == 2 and 'pip install "jobrun[wandb]"' in r.text and "Traceback" not in r.text
    line = PLAN.splitlines().index("loggers: [LOGGERS]") + 1
    assert f"plan.yaml:{line}:10: error: `loggers: [wandb]` needs the wandb package" in r.err, r.err
    # refused before the run directory is made: it was left behind as a run that "died"
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_fails_the_run_it_was_made_for(plan_file, tmp_path, monkeypatch):
    """The run's directory exists by then: run.json said running, and `jobrun runs` listed
    the run as died, with the error in no file (run.json holds it now)."""
    from jobrun.runner import trackers

    def unreachable(*args):
        raise ConnectionError("tracking server refused the connection")

    monkeypatch.setitem(trackers._OPEN, "csv", unreachable)
    run_dir = tmp_path / "run"
    r = jobrun("train", plan_file(PLAN.replace("LOGGERS", "csv")), "--run-dir", run_dir)
    assert r.code == 2 and "cannot start the csv logger: ConnectionError: tracking server refused" in r.err, r.text
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "failed" and "tracking server refused" in info["error"]


# -- Weights & Biases -----------------------------------------------------------------------


def test_wandb_offline_run_holds_the_config_and_the_logged_steps(plan_file, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _train(plan_file, tmp_path, "wandb", "max_epochs=2")
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    history = _wandb_history(offline / f"run-{run_id}.wandb")
    losses = [(row["_step"], row["train/loss"]) for row in history if "train/loss" in row]
    assert losses == [(s, v) for _, s, v in _logged_steps(run_dir)]
    config = _wandb_config(offline / f"run-{run_id}.wandb")
    assert config["vars.lr"] == 0.05 and config["overrides"] == "vars.lr=0.05 max_epochs=2"
    kinds = [rec.WhichOneof("record_type") for rec in _wandb_records(offline / f"run-{run_id}.wandb")]
    assert "artifact" in kinds  # the final model

    r = jobrun("resume", "--run-dir", run_dir, "max_epochs=3")
    assert r.code == 0, r.text
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"] == run_id
    # a run started in the same second as the last one gets a "-1" after its id
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2  # the same run id, continued (wandb sync merges them)
    resumed = [row["epoch"] for row in _wandb_history(runs[-1] / f"run-{run_id}.wandb") if "epoch" in row]
    assert resumed == [3]


def _wandb_records(path):
    """The records of an offline run's .wandb file: a LevelDB-style log (32 KiB blocks of
    chunks, each with a 7-byte header: crc32c, length, type) after a 7-byte file header,
    each record a wandb_internal_pb2.Record (the Python SDK has no reader of its own now)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, record = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(record)
            record = b""
            yield rec


def _wandb_history(path) -> list[dict]:
    rows = []
    for rec in _wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def _wandb_config(path) -> dict:
    config = {}
    for rec in _wandb_records(path):
        if rec.WhichOneof("record_type") == "config":
            for item in rec.config.update:
                config[item.key] = json.loads(item.value_json)
    return config


def test_a_tracker_that_cannot_start_is_one_clear_error(plan_file, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    r = jobrun("train", plan_file(PLAN.replace("LOGGERS", "mlflow")), "--run-dir", tmp_path / "run")
    assert r.code != 0 and "cannot start the mlflow logger" in r.text and "MLFLOW_TRACKING_URI" in r.text
    assert "Traceback" not in r.text
