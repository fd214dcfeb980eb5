"""Plain positioned data -> plan IR.

The compiler checks structure: keys, types, names, durations and sizes. Anything wrong
here is a PlanError (exit 2: the file cannot be read as a plan). Whether ops exist and
their arguments fit is the analyzer's business, so that `analyze` can report every such
problem at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobrun.errors import PlanError, Pos
from jobrun.plans import ir
from jobrun.plans.keys import (
    BEST_KEYS,
    CHECKPOINT_KEYS,
    DEVICE,
    EARLY_STOP_KEYS,
    LOGGERS,
    MAX_REPLICAS,
    MAX_RESTARTS,
    MODES,
    NAME_RULE,
    NODE_NAME,
    PARALLEL,
    TOP_KEYS,
)
from jobrun.plans.load import PList, PMap, load_file, load_text
from jobrun.plans.overrides import apply_sets
from jobrun.plans.resolve import substitute
from jobrun.plans.scalars import kind_of, show
from jobrun.plans.steps import StepCompiler, suggest


def compile_file(
    path: str | Path,
    sets: list[str] | tuple[str, ...] = (),
    run_dir: str | None = None,
    plan_dir: str | None = None,
) -> ir.Plan:
    """Load, override, substitute and compile a plan file."""
    return compile_tree(load_file(path), str(path), sets, run_dir=run_dir, plan_dir=plan_dir)


def compile_text(
    text: str,
    filename: str = "<plan>",
    sets: list[str] | tuple[str, ...] = (),
    run_dir: str | None = None,
    plan_dir: str | None = None,
) -> ir.Plan:
    """Like compile_file, for plan text that did not come from a file (tests, tools)."""
    return compile_tree(load_text(text, filename), filename, sets, run_dir=run_dir, plan_dir=plan_dir)


def compile_tree(
    tree: PMap,
    source: str,
    sets: list[str] | tuple[str, ...] = (),
    run_dir: str | None = None,
    plan_dir: str | None = None,
) -> ir.Plan:
    """Apply `sets`, substitute vars and compile. `tree` is updated in place, so that it
    holds the resolved plan afterwards (what a run stores)."""
    apply_sets(tree, sets)
    comp = _Compiler(source)
    comp.keys(tree, TOP_KEYS, "the plan")
    job = _job_name(tree)
    builtins = {
        "plan_dir": plan_dir if plan_dir is not None else str(Path(source).parent),
        "run_dir": run_dir if run_dir is not None else str(Path("runs") / job),
    }
    return comp.plan(substitute(tree, builtins))


def _job_name(tree: PMap) -> str:
    if "job" not in tree:
        raise PlanError("plan has no `job` name", tree.pos, "add `job: my-job` at the top")
    job = tree["job"]
    pos = tree.at("job")
    if not isinstance(job, str):
        raise PlanError(f"the job name must be a string, not {kind_of(job)}", pos, "write e.g. job: mnist-mlp")
    if "${" in job:
        raise PlanError(
            f"the job name {show(job)} uses a variable", pos,
            "write the name out (the run directory is named after it; --set job=NAME overrides it)",
        )
    if not NODE_NAME.match(job) or ".." in job:
        raise PlanError(f"bad job name {show(job)}", pos, f"a job name is {NAME_RULE}")
    return job


class _Compiler(StepCompiler):
    """The plan's top level (settings, checkpoint, early stopping) around the tasks."""

    # -- plan ------------------------------------------------------------------------
    def plan(self, t: PMap) -> ir.Plan:
        """The IR of a substituted tree whose top-level keys were checked."""
        job = t["job"]
        seed = self.int_(t.get("seed", 0), t.at("seed"), "seed", 0, 2**63 - 1)
        device = t.get("device", "auto")
        if not isinstance(device, str) or not DEVICE.match(device):
            raise PlanError(
                f"bad device {show(device)}" if isinstance(device, str) else f"device must be a string, not {kind_of(device)}",
                t.at("device"), "use auto, cpu, cuda or cuda:N",
            )
        replicas = t.get("replicas", 1)
        if isinstance(replicas, str):
            if replicas != "auto":
                raise PlanError(
                    f"replicas must be a number or auto, not {kind_of(replicas)}", t.at("replicas"),
                    f"write replicas: auto (one per GPU) or a number from 1 to {MAX_REPLICAS}",
                )
        else:
            replicas = self.int_(replicas, t.at("replicas"), "replicas", 1, MAX_REPLICAS)
        parallel = t.get("parallel", "ddp")
        if parallel not in PARALLEL:
            raise PlanError(
                f"parallel must be ddp or fsdp, not {show(parallel) if isinstance(parallel, str) else kind_of(parallel)}",
                t.at("parallel"),
                "ddp keeps a full model on every replica; fsdp shards parameters, gradients and "
                "optimizer state over the replicas (FSDP2)",
            )
        fsdp_layers = t.get("fsdp_layers")
        if fsdp_layers is not None and not (
            isinstance(fsdp_layers, PList) and fsdp_layers
            and all(isinstance(x, str) and x.strip() for x in fsdp_layers)
        ):
            raise PlanError(
                f"fsdp_layers must be a list of module classes, not {kind_of(fsdp_layers)}",
                t.at("fsdp_layers"), "write e.g. fsdp_layers: [torch.nn.TransformerEncoderLayer]",
            )
        max_restarts = self.int_(t.get("max_restarts", 0), t.at("max_restarts"), "max_restarts", 0,
                                 MAX_RESTARTS)
        vars_ = t.get("vars") or {}
        max_epochs = t.get("max_epochs")
        if max_epochs is not None:
            max_epochs = self.int_(max_epochs, t.at("max_epochs"), "max_epochs", 1)
        max_steps = t.get("max_steps")
        if max_steps is not None:
            max_steps = self.int_(max_steps, t.at("max_steps"), "max_steps", 1)
        stop_when = self.blobs(t.get("stop_when"), t.at("stop_when"), "stop_when")
        early = self.early_stop(t["early_stop"], t.at("early_stop")) if t.get("early_stop") is not None else None
        ckpt = self.checkpoint(t["checkpoint"], t.at("checkpoint")) if t.get("checkpoint") is not None else None
        loggers = self.loggers(t.get("loggers"), t.at("loggers"))
        if "epoch" not in t:
            raise PlanError("plan has no `epoch` group", t.pos, "add `epoch:` with at least one task")
        groups = {g: self.group(g, t.get(g), t.at(g), t.key_at(g)) for g in ir.GROUPS}
        if not groups["epoch"].tasks:
            raise PlanError(
                "the `epoch` group has no tasks", t.at("epoch"),
                "add a task under `epoch:`, e.g. `- task: train` with `do: [...]`",
            )
        return ir.Plan(
            job=job, seed=seed, device=device, replicas=replicas, vars=dict(vars_),
            max_epochs=max_epochs, stop_when=stop_when, checkpoint=ckpt,
            init=groups["init"], epoch=groups["epoch"], download=groups["download"],
            exit=groups["exit"], source=self.source, pos=t.pos, early_stop=early,
            max_restarts=max_restarts, parallel=parallel, fsdp_layers=tuple(fsdp_layers or ()),
            loggers=loggers, loggers_pos=t.at("loggers") if loggers else None,
            fsdp_layers_pos=t.at("fsdp_layers") if fsdp_layers else None,
            max_steps=max_steps,
        )

    def loggers(self, value: Any, pos: Pos) -> tuple[str, ...]:
        """`loggers: [mlflow, wandb, csv]`: each a known tracker, once."""
        if value is None:
            return ()
        names = [value] if isinstance(value, str) else self.seq(value, pos, "loggers", "loggers: [mlflow, csv]")
        out: list[str] = []
        for i, name in enumerate(names):
            at = names.at(i) if isinstance(names, PList) else pos
            if not isinstance(name, str) or name not in LOGGERS:
                shown = show(name) if isinstance(name, str) else kind_of(name)
                raise PlanError(f"unknown logger {shown} in loggers", at,
                                (suggest(name, LOGGERS) if isinstance(name, str) else None)
                                or f"the loggers are: {', '.join(LOGGERS)}")
            if name in out:
                raise PlanError(f"logger {show(name)} is named twice in loggers", at, "name each once")
            out.append(name)
        return tuple(out)

    def checkpoint(self, value: Any, pos: Pos) -> ir.Checkpoint:
        m = self.mapping(value, pos, "checkpoint", "checkpoint: {dir: checkpoints, every: 1}")
        self.keys(m, CHECKPOINT_KEYS, "checkpoint")
        d = m.get("dir", "checkpoints")
        if not isinstance(d, str) or not d.strip():
            raise PlanError(
                f"checkpoint.dir must be a directory path, not {kind_of(d)}", m.at("dir"),
                "write e.g. dir: checkpoints (relative to the run directory)",
            )
        every = self.int_(m.get("every", 1), m.at("every"), "checkpoint.every", 1)
        keep = m.get("keep")
        if keep is not None:
            if isinstance(keep, int) and not isinstance(keep, bool) and keep < 1:
                raise PlanError(
                    f"checkpoint.keep is {keep}; it must be at least 1", m.at("keep"),
                    "keep the last K epochs with keep: K, or all of them with keep: null",
                )
            keep = self.int_(keep, m.at("keep"), "checkpoint.keep", 1)
        upload = m.get("upload")
        if upload is not None and (not isinstance(upload, str) or not upload.strip()):
            raise PlanError(
                f"checkpoint.upload must be a directory path or null, not {kind_of(upload)}",
                m.at("upload"), "write e.g. upload: /shared/ckpt",
            )
        background = m.get("async", False)
        if not isinstance(background, bool):
            raise PlanError(
                f"checkpoint.async must be true or false, not {kind_of(background)}", m.at("async"),
                "async: true writes checkpoint files in the background while training goes on",
            )
        best = self.best(m["best"], m.at("best")) if m.get("best") is not None else None
        include, exclude = (self.blob_list(m, key) for key in ("include", "exclude"))
        return ir.Checkpoint(dir=d, every=every, keep=keep, upload=upload, background=background, pos=pos,
                             best=best, include=include, exclude=exclude)

    def early_stop(self, value: Any, pos: Pos) -> ir.EarlyStop:
        example = "early_stop: {monitor: val_loss, mode: min, patience: 3}"
        m = self.mapping(value, pos, "early_stop", example)
        self.keys(m, EARLY_STOP_KEYS, "early_stop")
        monitor = self.monitor(m, "early_stop", example)
        patience = self.int_(m.get("patience", 3), m.at("patience"), "early_stop.patience", 0)
        delta = m.get("min_delta", 0.0)
        if isinstance(delta, bool) or not isinstance(delta, int | float) or not delta >= 0:
            shown = kind_of(delta) if not isinstance(delta, int | float) or isinstance(delta, bool) else str(delta)
            raise PlanError(
                f"early_stop.min_delta must be a number >= 0, not {shown}", m.at("min_delta"),
                "an epoch improves on the best one when it is better by more than min_delta (0: any better value)",
            )
        return ir.EarlyStop(monitor, patience, float(delta), pos)

    def best(self, value: Any, pos: Pos) -> ir.Best:
        example = "best: {monitor: val_loss, mode: min, keep: 1}"
        m = self.mapping(value, pos, "checkpoint.best", example)
        self.keys(m, BEST_KEYS, "checkpoint.best")
        monitor = self.monitor(m, "checkpoint.best", example)
        keep = self.int_(m.get("keep", 1), m.at("keep"), "checkpoint.best.keep", 1)
        return ir.Best(monitor, keep, pos)

    def monitor(self, m: PMap, what: str, example: str) -> ir.Monitor:
        """`monitor:` (an epoch-task output, checked by analyze) and `mode:` of `what`."""
        if m.get("monitor") is None:
            raise PlanError(f"{what} has no `monitor`", m.pos, f"name the epoch-task output it watches: {example}")
        name = self.blob(m["monitor"], m.at("monitor"), f"{what}.monitor")
        mode = m.get("mode", "min")
        if mode not in MODES:
            raise PlanError(
                f"{what}.mode must be min or max, not {show(mode) if isinstance(mode, str) else kind_of(mode)}",
                m.at("mode"), f"{suggest(str(mode), MODES) or 'min: lower is better (a loss); max: higher (an accuracy)'}",
            )
        return ir.Monitor(name, mode)

    def blob_list(self, m: PMap, key: str) -> tuple[ir.BlobRef, ...]:
        """`checkpoint.include`/`exclude`: a list of blob names (or one, or null)."""
        value = m.get(key)
        if value is not None and not isinstance(value, str | PList):
            raise PlanError(
                f"checkpoint.{key} must be a list of blob names, not {kind_of(value)}", m.at(key),
                f"write e.g. {key}: [model, opt]",
            )
        return self.blobs(value, m.at(key), f"checkpoint.{key}")

