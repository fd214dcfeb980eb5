"""Models and optimizers: `build`, `model.mlp`, `optimizer`, `scheduler`,
`scheduler.step`, and `export`.

Everything built from a plan is seeded from the node's generator, so every rank of a
data-parallel job builds the same parameters (and rank 0's are broadcast anyway).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from jobrun import safedel, safefs
from jobrun.errors import RunError, a_type, did_you_mean, said
from jobrun.ops import nested, optim
from jobrun.ops.context import OpContext
from jobrun.ops.data import as_tensor, require_int
from jobrun.ops.dist import broadcast_tensors, replicate_module
from jobrun.ops.imports import resolve
from jobrun.ops.nested import NESTING_OPS

_NONE: Iterator[Any] = iter(())  # no nested blobs (an exhausted iterator stays exhausted)


@contextlib.contextmanager
def _seeded(ctx: OpContext) -> Iterator[None]:
    """Construct under a seed drawn from the node's generator: same on every rank.

    Only the CPU generator is reseeded (and restored after): module initialisation
    draws from it, and the global CUDA streams stay as the job left them.
    """
    seed = int(torch.randint(0, 2**62, (1,), generator=ctx.generator))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def _place_module(ctx: OpContext, module: nn.Module, compile: bool = False) -> nn.Module:
    """The module on the run's device, identical on every rank, made data parallel
    (ddp) or sharded (fsdp) with replicas; with ``compile``, its forward compiled by
    torch.compile in place (``nn.Module.compile``: no ``OptimizedModule`` wrapper, so the
    state dict and checkpoints keep the module's own keys, each weight once)."""
    module = module.to(ctx.device)
    if ctx.distributed:  # cheap insurance: parameters start identical on every rank
        with torch.no_grad():
            broadcast_tensors(ctx, [*module.parameters(), *module.buffers()], src=0)
        if ctx.parallel == "fsdp":
            from jobrun.ops.fsdp import shard

            shard(module, ctx.fsdp_layers, ctx.fsdp_amp)
        elif any(p.requires_grad for p in module.parameters()):
            replicate_module(ctx, module)  # torch's DDP: gradients all-reduced in the backward
    if compile:
        module.compile()
    return module


def _materialize(op: str, value: Any, optimizer: Any = None, blobs: Iterator[Any] = _NONE) -> Any:
    """Instantiate nested `{target: ..., in: [...], args: [...], **kwargs}` mappings, depth
    first. ``optimizer``: given to nested learning-rate schedulers as their first argument
    (the ones SequentialLR or ChainedScheduler combine). ``blobs``: the values of the
    blobs nested targets name with `in`, in the order of jobrun.ops.nested."""
    if isinstance(value, dict):
        if "target" in value:
            names = value.get("in")
            if names is not None and op not in NESTING_OPS:
                raise RunError(f"{op}: a nested target cannot name blobs with `in`",
                               hint="build the object with `build` and give it as an input")
            named = {k: next(blobs) for k in names} if isinstance(names, dict) else {}
            count = len(names) if isinstance(names, list) else int(names is not None and not named)
            leading = tuple(next(blobs) for _ in range(count))
            rest = {k: v for k, v in value.items() if k not in ("target", "args", "in")}
            rest.update(named)
            return _instantiate(op, value["target"], value.get("args") or [], rest, leading,
                                optimizer=optimizer, blobs=blobs)
        return {k: _materialize(op, v, optimizer, blobs) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_materialize(op, v, optimizer, blobs) for v in value]
    return value


def _instantiate(op: str, target: Any, args: Any, kwargs: dict[str, Any], leading: tuple = (),
                 optimizer: Any = None, blobs: Iterator[Any] = _NONE) -> Any:
    """`target` called with `leading`, then `args`, and `kwargs` (nested targets built)."""
    if not isinstance(args, list | tuple):
        raise RunError(f"{op}: `args` of {target!r} must be a list, got {args!r}")
    fn = resolve(target, op, "target")
    if optimizer is not None and not leading and isinstance(fn, type) \
            and issubclass(fn, torch.optim.lr_scheduler.LRScheduler):
        leading = (optimizer,)
    args = [*leading, *_materialize(op, list(args), optimizer, blobs)]
    kwargs = _materialize(op, kwargs, optimizer, blobs)
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        if e.__traceback__ is None or e.__traceback__.tb_next is not None:
            raise  # raised inside the code: the run shows its traceback, as a `call`'s
        # raised by the call itself: the arguments do not bind to the signature
        raise RunError(f"{op}: {target}(...) cannot take the arguments given: {said(e)}",
                       hint="check the arguments given in the plan against its signature") from e


def build(ctx: OpContext, *inputs: Any, target: str, args: list | None = None,
          fork_rng: bool = False, compile: bool = False, **kwargs: Any):
    """`build`: inputs... -> obj, drawing its random numbers from torch's global generator
    as a hand loop's constructor does (after ``torch.manual_seed(seed)``: the job seeds it
    alike on every process, so every rank builds the same parameters). ``fork_rng``: under
    a seed drawn from the node's generator instead, as model.mlp, leaving the global stream
    where it was. ``compile``: a module's forward goes through torch.compile."""
    own, blobs = nested.split(inputs, args, kwargs)
    with _seeded(ctx) if fork_rng else contextlib.nullcontext():
        obj = _instantiate("build", target, args or [], kwargs, leading=own, blobs=blobs)
    if compile and not isinstance(obj, nn.Module):
        raise RunError(f"build: compile applies to modules; {target} made a {type(obj).__name__}",
                       hint="drop `compile: true`, or build an nn.Module")
    return _place_module(ctx, obj, compile) if isinstance(obj, nn.Module) else obj


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
}


def model_mlp(
    ctx: OpContext, *, sizes: list[int], activation: str = "relu", dropout: float = 0.0,
    compile: bool = False,
) -> nn.Module:
    """`model.mlp`: an nn.Sequential of Linear layers, activation (+ dropout) between."""
    if not isinstance(sizes, list | tuple) or len(sizes) < 2:
        raise RunError(f"model.mlp: sizes must list [in, hidden..., out], got {sizes!r}")
    for s in sizes:
        require_int("model.mlp", "every size", s, 1)
    if activation not in _ACTIVATIONS:
        raise RunError(
            f"model.mlp: unknown activation {activation!r}",
            hint=did_you_mean(activation, _ACTIVATIONS) or f"one of {sorted(_ACTIVATIONS)}",
        )
    if not 0.0 <= dropout < 1.0:
        raise RunError(f"model.mlp: dropout must be in [0, 1), got {dropout}")
    with _seeded(ctx):
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(_ACTIVATIONS[activation]())
                if dropout > 0:
                    layers.append(nn.Dropout(dropout))
        model = nn.Sequential(*layers)
    return _place_module(ctx, model, compile)


def optimizer(ctx: OpContext, model: Any, *, target: str | None = None,
              groups: list | None = None, **kwargs: Any):
    """`optimizer`: model -> opt; `class` names one of torch.optim (else `target`, SGD by
    default); `groups` makes parameter groups by rule (jobrun.ops.optim); every other key
    goes to the optimizer's constructor."""
    path = optim.optimizer_class(kwargs.pop("class", None), target)
    params = model.parameters() if isinstance(model, nn.Module) else model
    if groups is not None:
        cls = resolve(path, "optimizer", "class")
        params = optim.param_groups(model, groups, cls)
    return _instantiate("optimizer", path, [], kwargs, leading=(params,))


def scheduler(ctx: OpContext, opt: Any, *, target: str | None = None, warmup: int = 0,
              decay: str = "cosine", steps: int | None = None, min_lr: float | None = None,
              min_ratio: float = 0.0, **kwargs: Any):
    """`scheduler`: opt -> sched, e.g. target: torch.optim.lr_scheduler.StepLR. Nested
    schedulers (SequentialLR's `schedulers`) are built on the same optimizer. Without a
    target: warmup and decay by the global step, in closed form (jobrun.ops.schedule)."""
    require_optimizer("scheduler", opt)
    schedule = {"warmup": warmup, "decay": decay, "steps": steps, "min_lr": min_lr, "min_ratio": min_ratio}
    if target is None:
        from jobrun.ops.schedule import closed_form

        return closed_form(ctx, opt, schedule, kwargs)
    from jobrun.ops.schedule import beside_target

    defaults = {"warmup": 0, "decay": "cosine", "steps": None, "min_lr": None, "min_ratio": 0.0}
    found = beside_target([k for k, v in schedule.items() if v != defaults[k]], target)
    if found is not None:
        raise RunError(found[1], hint=found[2])
    return _instantiate("scheduler", target, [], kwargs, leading=(opt,), optimizer=opt)


_NO_METRIC = object()  # scheduler.step given one input (a second that is null is None)


def scheduler_step(ctx: OpContext, sched: Any, metric: Any = _NO_METRIC) -> None:
    """`scheduler.step`: sched[, metric] ->. The metric feeds ReduceLROnPlateau."""
    if not hasattr(sched, "step"):
        hint = ("a scheduler without a target steps with its optimizer: remove scheduler.step"
                if type(sched).__name__ == "StepSchedule" else None)
        raise RunError(f"scheduler.step expects a scheduler, got {a_type(sched)}", hint=hint)
    fault = metric_fault(type(sched), given=metric is not _NO_METRIC)
    if fault is None and metric is None and step_takes_metric(type(sched)):
        fault = RunError(f"{type(sched).__name__}'s metric is null: it cannot step on it",
                         hint="step it only in the epochs that compute the metric (inside an `if`)")
    if fault is not None:
        raise fault
    if metric is _NO_METRIC or metric is None:
        sched.step()
    else:
        sched.step(float(metric))


@functools.cache  # per class: `scheduler.step` may run at every optimizer step, a signature costs 25 us
def step_takes_metric(cls: type) -> bool | None:
    """Whether a scheduler class's `step` takes a metric: True when it must (torch's
    ReduceLROnPlateau, `step(metrics)`), False when it takes none (torch's other
    schedulers: their one argument is a deprecated epoch number, for which they set the
    rate in closed form), None when its signature cannot tell."""
    try:
        params = list(inspect.signature(cls.step).parameters.values())[1:]  # self
    except (AttributeError, TypeError, ValueError):
        return None
    if not params or params[0].name == "epoch":
        return False
    first = params[0]
    if first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        return None
    return True if first.default is first.empty else None


def metric_fault(cls: type, *, given: bool) -> RunError | None:
    """What is wrong with `scheduler.step` giving (or not) a metric to a scheduler of
    ``cls``; None when nothing is (or its signature cannot tell). One rule, checked before
    the run for a `scheduler` with a target and here for any scheduler."""
    takes, name = step_takes_metric(cls), cls.__name__
    if given and takes is False:
        return RunError(f"scheduler.step: {name} takes no metric, but scheduler.step gives it one",
                        hint="remove the second input: `scheduler.step: {in: sched}` (torch would take "
                             "the metric as the epoch number and set that epoch's rate)")
    if not given and takes:
        return RunError(f"scheduler.step: {name} steps on a metric, and scheduler.step gives it none",
                        hint="give the value it watches as the second input, e.g. "
                             "`scheduler.step: {in: [sched, val_loss]}`")
    return None


def optimizer_rate(ctx: OpContext, opt: Any, *, group: int = 0) -> float:
    """`optimizer.rate`: opt -> lr, the learning rate of parameter group `group` as it is now
    (Lightning's LearningRateMonitor): what a scheduler set last, as a float."""
    made_on = getattr(opt, "optimizer", None) or getattr(opt, "opt", None)  # torch's schedulers, jobrun's
    if not isinstance(opt, torch.optim.Optimizer) and (hasattr(opt, "step") or made_on is not None):
        raise RunError(f"optimizer.rate expects an optimizer, got {a_type(opt)}",
                       hint="give the optimizer the scheduler was made on (the scheduler's `in`)")
    require_optimizer("optimizer.rate", opt)
    groups = opt.param_groups
    if group >= len(groups):
        raise RunError(f"optimizer.rate: group {group} is not one of the optimizer's {len(groups)} "
                       "parameter group(s)", hint=f"group: 0 to {len(groups) - 1}")
    return float(groups[group]["lr"])


def require_optimizer(op: str, opt: Any) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise RunError(
            f"{op} expects an optimizer, got {a_type(opt)}",
            hint="create one with `optimizer: {in: model, out: opt, lr: 0.1}`",
        )


def export(
    ctx: OpContext,
    model: nn.Module,
    example_input: Any,
    *,
    path: str = "model.pt2",
    dynamic_batch: bool = True,
) -> str:
    """`export`: model, example_input -> path of a torch.export program (eval mode).

    Rank 0 writes; the others wait for it, so the file exists when every rank goes on.
    """
    if not isinstance(model, nn.Module):
        raise RunError(f"export expects an nn.Module, got {a_type(model)}")
    out = ctx.resolve_write(path)
    if ctx.rank == 0:
        program = _export_program(ctx, model, example_input, dynamic_batch)
        try:
            safefs.make_dirs_under(ctx.run_dir, out.parent)
            safefs.write_with(out, lambda f: torch.export.save(program, f))
            safedel.record_written(ctx.run_dir, out)  # train --overwrite deletes it then
        except safefs.UnsafeFile as e:
            raise RunError(f"export: refusing to write {out}: {e.strerror}",
                           hint="remove it, or export to another path") from None
    if ctx.distributed:
        torch.distributed.barrier()
    return str(out)


def _export_program(ctx: OpContext, model: nn.Module, example: Any, dynamic_batch: bool):
    items = example if isinstance(example, list | tuple) else [example]
    args = tuple(as_tensor(v, ctx.device, "export example_input") for v in items)
    # AUTO lets dim 0 vary, or specialises it silently (e.g. a batch of one).
    dims = tuple({0: torch.export.Dim.AUTO} if a.dim() > 0 else None for a in args)
    was_training = model.training
    model.eval()
    try:
        return torch.export.export(model, args, dynamic_shapes=dims if dynamic_batch else None)
    except Exception as e:
        raise RunError(
            f"export: torch.export failed: {type(e).__name__}: {e}",
            hint="the model's forward must be traceable; try dynamic_batch: false",
        ) from e
    finally:
        model.train(was_training)


