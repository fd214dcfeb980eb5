"""Experiment trackers (`loggers: [mlflow, wandb, csv]`): what a run logs, sent on.

Each tracker receives, on rank 0: every `log` call's numeric values as ``<task>/<name>``
at the call's `step` (the one metrics.jsonl records), each epoch's numeric outputs and
throughput (``epoch/<task>/<name>``, ``system/samples_per_s``...) at the last step logged,
the run's vars and overrides as parameters, and, when the run finishes, each model blob
(its state_dict as safetensors) as an artifact.

Trackers are optional extras, imported only when a plan names them:

- ``mlflow`` (``pip install "jobrun[mlflow]"``): an SQLite store in the run directory
  (``mlflow.db``, artifacts in ``mlartifacts/``) unless MLFLOW_TRACKING_URI names another;
  ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`` shows it.
- ``wandb`` (``pip install "jobrun[wandb]"``): offline under RUN_DIR/wandb unless WANDB_MODE
  says otherwise; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later.
- ``csv``: RUN_DIR/metrics.csv, one row per value (epoch, step, task, name, value).

A resume continues the same tracker runs: their ids are kept in RUN_DIR/trackers.json.
Trackers run in a thread of their own, which sends the values at most every `FLUSH_S`
seconds, in one batch (and at the end): a store's cost per call (an SQLite transaction
for MLflow) would otherwise cost a small model's epochs several percent of their time. A
tracker that fails is dropped with one warning, and training goes on.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobrun import safefs
from jobrun.errors import UsageError
from jobrun.runner.monitor import scalar

IDS_FILE = "trackers.json"
CSV_FILE = "metrics.csv"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
FLUSH_S = 5.0  # the most seconds logged values wait before the trackers receive them
JOIN_S = 300.0  # how long the end of a run waits for the trackers to store what they have


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class Trackers:
    """The run's trackers behind one queue; every method returns at once."""

    def __init__(self, names: tuple[str, ...], run_dir: Path, job: str, resume_epoch: int | None,
                 params: dict[str, Any], warn: Callable[[str], None]):
        self.run_dir = run_dir
        self.warn = warn
        self.step = 0  # the last step a value was logged at: where epoch figures go
        self.ids = _read_ids(run_dir) if resume_epoch is not None else {}
        self.active: list[Any] = []
        for name in names:
            try:
                tracker = _OPEN[name](run_dir, job, self.ids.get(name), resume_epoch)
            except ImportError as e:
                raise UsageError(f"`loggers: [{name}]` needs the {name} package: {e}",
                                 hint=f'install the extra: pip install "jobrun[{name}]"') from None
            except Exception as e:  # noqa: BLE001 - the tracker's own error, said once
                raise UsageError(f"cannot start the {name} logger: {type(e).__name__}: {e}",
                                 hint=f"check its settings ({_SETTINGS[name]}), or remove {name} "
                                 "from `loggers`") from None
            self.active.append(tracker)
            self.ids[name] = tracker.id
        _write_ids(run_dir, self.ids)
        # A local file is written as values come (a few microseconds), not after the
        # thread's FLUSH_S: a kill -9 then loses no row that metrics.jsonl holds, and a
        # resume keeps the rows up to its checkpoint (batched, they were lost).
        self.local = [t for t in self.active if getattr(t, "local", False)]
        self.active = [t for t in self.active if t not in self.local]
        self.local_lock = threading.Lock()  # tasks of one group log from their own threads
        self.queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self.thread.start()
        if resume_epoch is None:
            self._put("params", {k: v for k, v in params.items() if v is not None})

    # -- what the runner sends ----------------------------------------------------------
    def log(self, task: str, step: int, values: dict[str, Any]) -> None:
        numbers = {f"{task}/{k}": float(v) for k, v in values.items() if _number(v)}
        self.step = max(self.step, step)
        if numbers:
            self._metrics(numbers, step, None)

    def epoch(self, epoch: int, outputs: dict[str, dict[str, Any]], rates: dict[str, Any]) -> None:
        numbers = {f"epoch/{t}/{k}": float(v) for t, o in outputs.items()
                   for k, v in ((k, scalar(v)) for k, v in o.items()) if _number(v)}
        numbers.update({f"system/{k}": float(v) for k, v in rates.items() if _number(v)})
        numbers["epoch"] = float(epoch)
        self._metrics(numbers, self.step or epoch, epoch)

    def _metrics(self, numbers: dict[str, float], step: int, epoch: int | None) -> None:
        if self.local:
            with self.local_lock:
                self._each("metrics", ([(numbers, step, epoch)],), self.local)
        if self.active:
            self._put("metrics", numbers, step, epoch)

    def finish(self, status: str, nodes: dict[str, Any]) -> None:
        """Send the models the nodes hold (a finished run), end every tracker run, and wait
        for the thread."""
        models = _models(nodes) if status == "finished" else {}
        if models:
            try:
                self._put("artifact", _model_files(models))
            except Exception as e:  # noqa: BLE001 - a model that cannot be saved: said, not fatal
                self.warn(f"the final model was not sent to the trackers: {e}")
        self._put("close", status)
        self.queue.put(None)
        self.thread.join(JOIN_S)
        if self.thread.is_alive():
            self.warn(f"the trackers did not finish within {JOIN_S:.0f} s; what they had not "
                      "stored yet is lost")
        self._each("close", (status,), self.local)

    # -- the thread -----------------------------------------------------------------------
    def _put(self, what: str, *args: Any) -> None:
        self.queue.put((what, args))

    def _work(self) -> None:
        import time

        pending: list[tuple[Any, ...]] = []  # metrics not sent yet: (values, step, epoch)
        due = time.monotonic() + FLUSH_S
        while True:
            try:
                item = self.queue.get(timeout=max(due - time.monotonic(), 0.0) if pending else None)
            except queue.Empty:
                item = ("flush", ())
            if item is not None and item[0] == "metrics":
                pending.append(item[1])
                if time.monotonic() < due:
                    continue
            if pending:  # in order: the values logged before what comes now
                self._each("metrics", (pending,))
                pending = []
                due = time.monotonic() + FLUSH_S
            if item is None:
                return
            what, args = item
            if what in ("params", "artifact", "close"):
                self._each(what, args)
            if what == "artifact":
                args[0].cleanup()

    def _each(self, what: str, args: tuple[Any, ...], trackers: list[Any] | None = None) -> None:
        trackers = self.active if trackers is None else trackers
        for tracker in list(trackers):
            try:
                getattr(tracker, what)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                trackers.remove(tracker)
                self.warn(f"{tracker.name} stopped receiving this run's values: "
                          f"{type(e).__name__}: {e}")


def for_run(plan: Any, resume_epoch: int | None, run_dir: Any, warn: Callable[[str], None]) -> Trackers:
    """The trackers of a run's plan (rank 0): its vars and overrides are the parameters."""
    params = {f"vars.{k}": _param(v) for k, v in plan.vars.items()}
    try:
        sets = run_dir.info().sets or []
    except Exception:  # noqa: BLE001 - a run.json that cannot be read: no overrides to send
        sets = []
    params["overrides"] = " ".join(map(str, sets))
    params["job"] = plan.job
    return Trackers(plan.loggers, run_dir.path, plan.job, resume_epoch, params, warn)


def _param(v: Any) -> Any:
    return v if isinstance(v, int | float | str | bool) else json.dumps(v, default=str)


def _models(nodes: dict[str, Any]) -> dict[str, Any]:
    """The modules the nodes hold: <node>.<blob> -> module (the node only when it is one)."""
    import torch

    found = {(name, k): v for name, node in nodes.items() for k, v in node.globals.items()
             if isinstance(v, torch.nn.Module)}
    one = len(nodes) == 1
    return {k if one else f"{name}.{k}": v for (name, k), v in found.items()}


def _model_files(models: dict[str, Any]) -> tempfile.TemporaryDirectory:
    """Each model's state_dict as <name>.safetensors in a private temporary directory
    (the trackers copy it into their own stores)."""
    from safetensors.torch import save_model

    tmp = tempfile.TemporaryDirectory(prefix="jobrun-model-")
    for name, module in models.items():
        save_model(module, os.path.join(tmp.name, f"{name.replace('/', '.')}.safetensors"))
    return tmp


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        data = json.loads(safefs.read_bounded(run_dir / IDS_FILE, 1 << 16))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(data, dict) else {}


def _write_ids(run_dir: Path, ids: dict[str, str]) -> None:
    safefs.write_atomic(run_dir / IDS_FILE, (json.dumps(ids, indent=1) + "\n").encode())


# -- the trackers ---------------------------------------------------------------------------


class CsvTracker:
    """RUN_DIR/metrics.csv: epoch, step, task, name, value (a resume drops the rows of the
    epochs after its checkpoint, as metrics.jsonl's)."""

    name = "csv"
    local = True  # written by the training thread as values come (Trackers.local)
    HEADER = ("epoch", "step", "name", "value")

    def __init__(self, run_dir: Path, job: str, run_id: str | None, resume_epoch: int | None):
        self.id = "metrics.csv"
        path = run_dir / CSV_FILE
        self.epoch = resume_epoch or 0
        if resume_epoch is not None:
            try:
                rows = list(csv.reader(io.StringIO(safefs.read_bounded(path, 1 << 31).decode())))
            except OSError:
                rows = []
            kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= resume_epoch]
            self._replace(path, [list(self.HEADER), *kept])
        elif not path.exists():
            self._replace(path, [list(self.HEADER)])
        self.fd = safefs.open_write(path, append=True)

    @staticmethod
    def _replace(path: Path, rows: list[list[str]]) -> None:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows)
        safefs.write_atomic(path, out.getvalue().encode(), durable=False)

    def params(self, params: dict[str, Any]) -> None:
        pass  # run.json holds them

    def metrics(self, batches: list[tuple[dict[str, float], int, int | None]]) -> None:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        for values, step, epoch in batches:
            # A value logged during epoch E belongs to E (the runner says when E ends).
            tag = epoch if epoch is not None else self.epoch + 1
            if epoch is not None:
                self.epoch = epoch
            w.writerows([tag, step, k, repr(v)] for k, v in values.items())
        safefs.write_all(self.fd, out.getvalue().encode())

    def artifact(self, files: Any) -> None:
        pass

    def close(self, status: str) -> None:
        os.close(self.fd)


class MlflowTracker:
    """An MLflow run, through MlflowClient (no global state: the user's own mlflow use is
    left alone)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, job: str, run_id: str | None, resume_epoch: int | None):
        import logging

        from mlflow.tracking import MlflowClient

        # Creating the SQLite store logs each migration step at INFO: not the run's news.
        for name in ("mlflow.store.db.utils", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / MLFLOW_DB}"
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.id = run_id
            return
        exp = self.client.get_experiment_by_name(job)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            job, artifact_location=(run_dir.resolve() / MLFLOW_ARTIFACTS).as_uri())
        self.id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id

    def params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    def metrics(self, batches: list[tuple[dict[str, float], int, int | None]]) -> None:
        import time

        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(k, v, ms, step) for values, step, _ in batches for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 in one batch
            self.client.log_batch(self.id, metrics=metrics[i:i + 1000])

    def artifact(self, files: Any) -> None:
        self.client.log_artifacts(self.id, files.name, "model")

    def close(self, status: str) -> None:
        self.client.set_terminated(
            self.id, {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


class WandbTracker:
    """A Weights & Biases run: offline by default (WANDB_MODE chooses otherwise)."""

    name = "wandb"

    def __init__(self, run_dir: Path, job: str, run_id: str | None, resume_epoch: int | None):
        import wandb

        # No system sampling nor console capture: jobrun has console.log and the epoch
        # records, and both cost the training process CPU.
        settings = wandb.Settings(x_disable_stats=True, console="off", x_disable_meta=True)
        self.run = wandb.init(project=job, dir=str(run_dir), name=run_dir.name,
                              mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
                              id=run_id, resume="allow" if run_id else None, reinit="create_new",
                              settings=settings)
        self.id = self.run.id

    def params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, batches: list[tuple[dict[str, float], int, int | None]]) -> None:
        for values, step, _ in batches:
            self.run.log({**values, "step": step}, step=step)

    def artifact(self, files: Any) -> None:
        import wandb

        art = wandb.Artifact(f"{self.run.project}-model", type="model")
        art.add_dir(files.name)
        self.run.log_artifact(art)

    def close(self, status: str) -> None:
        import wandb

        self.run.finish(exit_code=0 if status == "finished" else 1)
        # finish() may return before W&B's service has written a resumed offline run's
        # file (seen with wandb 0.31); teardown waits for it. jobrun's process owns wandb.
        wandb.teardown()


_OPEN: dict[str, Callable[..., Any]] = {"csv": CsvTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}
_SETTINGS = {"csv": "the run directory must be writable", "mlflow": "MLFLOW_TRACKING_URI",
             "wandb": "WANDB_MODE and the other WANDB_* variables"}
