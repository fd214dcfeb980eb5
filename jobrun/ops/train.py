"""Training: `train.step` and `evaluate` (losses: :mod:`jobrun.ops.losses`; collectives:
:mod:`jobrun.ops.dist`).

Both ops give the same numbers with one process and with replicas (see
:mod:`jobrun.ops.dist`): `train.step`'s gradients and loss are those of the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from jobrun.errors import RunError, a_type
from jobrun.ops.batches import counter, records
from jobrun.ops.context import OpContext
from jobrun.ops.data import as_tensor, require_int
from jobrun.ops.dist import (
    GlobalCount,
    Totals,
    allreduce_grads,
    allreduce_sparse,
    broadcast_tensors,
    carrier_of,
    comm_device,
    fsdp_sums,
    sparse_params,
    stop_flags,
)
from jobrun.ops.losses import LOSSES as _LOSSES
from jobrun.ops.losses import MODEL, accuracy_logits, forward, model_loss
from jobrun.ops.losses import loss_fn as _loss_fn
from jobrun.ops.models import require_optimizer
from jobrun.ops.reader import Reader
from jobrun.ops.split import global_records

# ------------------------------------------------------------------------ train.step

_Optimizer = torch.optim.Optimizer
_Tensor = torch.Tensor
_FLOAT32 = torch.float32
_FLOAT16 = torch.float16


# y of a train.step with 3 inputs, `in: [model, opt, batch]`: x is one dict batch
_ONE_BATCH: Any = object()


def train_step(
    ctx: OpContext,
    model: Any,
    opt: Any,
    x: Any,
    y: Any = _ONE_BATCH,
    *,
    loss: str = "cross_entropy",
    clip_grad_norm: float | None = None,
    accumulate: int = 1,
    amp: str | None = None,
) -> torch.Tensor:
    """`train.step`: one optimizer step; returns the loss averaged over the global batch.

        zero_grad; for each micro-batch: forward (autocast with amp), loss weighted by its
        share of the global batch, backward [gradients summed over replicas by DDP's hooks
        in the last one]; [clip the gradient norm]; optimizer step; [buffers follow rank 0]

    With one process, one micro-batch and no amp that is exactly a hand-written loop's
    calls. ``amp`` autocasts the forward and the loss to bf16 or fp16 on the run's device
    (CPU or CUDA, the same code); fp16 scales the loss with a GradScaler whose state is
    kept in the optimizer's first param group, so that checkpoints hold it. The weights
    make the summed gradients those of one process reading the whole global batch.

    The loss comes back as a float32 0-d tensor on the run's device, identical on every
    rank, and nothing here waits for the device: its value is read when something needs
    it (a comparison, `log`, the epoch line). Replicas sum float32 values (a float64
    loss is rounded to float32 too, so that one process and replicas report the same
    numbers); with a model made data parallel when it was built (DDP, see
    :func:`jobrun.ops.dist.replicate_module`) the loss rides with the gradients, and
    the global batch size comes from the reader's split (no collective of its own).
    """
    # Every line runs once per training step, between torch's kernels, where Python work
    # costs several times what a micro-benchmark shows (cold caches): the common case
    # reads attributes, calls nothing it can do without, and skips conversions.
    if not isinstance(opt, _Optimizer):
        require_optimizer("train.step", opt)
    if accumulate.__class__ is not int or accumulate < 1:
        require_int("train.step", "accumulate", accumulate, 1)
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise RunError(f"train.step: clip_grad_norm must be > 0, got {clip_grad_norm}")
    loss_fn = _LOSSES[loss] if loss in _LOSSES else _loss_fn(loss, "train.step")
    dtype = None if amp is None else amp_dtype(amp)
    device = ctx.device
    if not (
        x.__class__ is _Tensor and y.__class__ is _Tensor
        and x.is_cpu and y.is_cpu and device == "cpu"
    ):  # fmt: skip
        if y is _ONE_BATCH or isinstance(x, Mapping):  # a dict batch: y counts its records
            x, y = _dict_batch(x, y, device, loss_fn)
        else:
            x = as_tensor(x, device, "train.step input x")
            y = as_tensor(y, device, "train.step input y")
    shape = y.shape
    local = shape[0] if shape else 1  # an unbatched record (a 0-d label) counts as one
    replicas = ctx.world_size > 1
    # Decided once per call, in one test: with one process, no amp and one micro-batch the
    # step is a hand-written loop's lines; replicas, amp and accumulate take _backward,
    # which weights, scales and synchronises (each of its tests cost 0.8 % of a tiny
    # MLP's step when run here for every step).
    if replicas or dtype is not None or (accumulate != 1 and shape):
        value, mean, scaler, params = _backward(ctx, model, opt, x, y, loss_fn, accumulate, dtype,
                                                clip_grad_norm, local, replicas)
    else:
        if not local:
            raise _empty_batch()
        opt.zero_grad(set_to_none=True)
        value = loss_fn(model(x), y) if loss_fn is not model_loss else model_loss(model, x, y)
        value.backward()
        mean = scaler = params = None
    if clip_grad_norm is not None:
        # model.parameters()'s order, as a hand loop clips (the norm sums in that order);
        # the optimizer's parameters when the model is no Module
        clipped = model.parameters() if isinstance(model, nn.Module) else params or _trained_params(opt)
        torch.nn.utils.clip_grad_norm_(clipped, float(clip_grad_norm))
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    if replicas and isinstance(model, nn.Module):
        with torch.no_grad():  # e.g. BatchNorm running statistics follow rank 0
            broadcast_tensors(ctx, list(model.buffers()), src=0)
    # Keep the loss (with its autograd nodes) until the next step, as a hand-written
    # loop's variable does: freed while the next forward allocates, it measured 1.5-2.5
    # us a step cheaper than freed on return.
    _last_loss[0] = value
    if mean is None:
        # `.data`, not `.detach()`: the same values without the graph, 1 us a step less
        # on a tiny MLP (0.4 %); what autograd would check (in-place changes to a value
        # its backward needs) cannot happen, its backward ran.
        mean = value.data
    return mean if mean.dtype is _FLOAT32 else mean.float()


def _backward(ctx: OpContext, model: Any, opt: Any, x: Any, y: Any, loss_fn: Any, accumulate: int,
              dtype: torch.dtype | None, clip_grad_norm: float | None, local: int,
              replicas: bool) -> tuple[torch.Tensor, torch.Tensor | None, Any, list | None]:
    """`train.step`'s zero_grad, forwards and backwards with replicas, amp or micro-batches:
    (this rank's loss, the global mean when replicas computed it, the fp16 loss scaler
    (gradients unscaled), the optimizer's parameters when they were needed)."""
    device = ctx.device
    shape = y.shape
    # Sharded by `build` under fsdp (fsdp.shard marks it); one user code made: as under ddp
    sharded = replicas and hasattr(model, "_jobrun_totals")
    # What carries the step's Totals with the gradients: DDP's hook, FSDP's reduce-scatter (None:
    # sharded by a torch without custom reduce-scatters, or a model DDP does not hold: allreduce_grads).
    carrier = (getattr(model, "_jobrun_totals", None) if sharded else carrier_of(model)) if replicas else None
    ddp = carrier is not None and not sharded
    if replicas:
        stop_flags.exchange()  # raises Interrupted on every rank when one was signalled
    scaler = _scaler(opt, device) if dtype is _FLOAT16 else None
    # Each rank's loss is weighted by its share of the global batch, whose size the
    # reader's split tells every rank (global_records): the same code for ddp and fsdp,
    # and no collective to count it. A batch no reader split: each rank backpropagates its
    # loss sum, its records ride with the loss (Totals), and the gradients are divided by
    # all ranks' records after the backward, on the device. Not with fp16, whose loss
    # scaler would see the magnitude of a sum and skip other steps than one process: its
    # records are all-reduced while the first forward runs (GlobalCount).
    known = global_records(y) if replicas else None
    count = GlobalCount(ctx, local) if replicas and known is None and scaler is not None else None
    summed = replicas and known is None and count is None
    opt.zero_grad(set_to_none=True)
    batches = ((x, y, local),) if accumulate == 1 or not shape else _micro_batches(x, y, accumulate)
    last = len(batches) - 1
    if ddp and local:  # the rank's last micro-batch with records: a rank of fewer records than
        last = max(i for i, b in enumerate(batches) if b[2])  # micro-batches runs no empty one
    value = None  # this rank's sum of the micro-batches' losses, each weighted by its share
    totals = None  # replicas: what the last backward carries (the ranks' losses, records)
    with fsdp_sums(model) if sharded else contextlib.nullcontext():
        for i, (xb, yb, n) in enumerate(batches):
            if ddp and len(batches) > 1 and i <= last:  # DDP all-reduces in the last backward only
                model.set_requires_gradient_sync(i == last)  # (and is left syncing, for a `call`'s)
            if n:
                if dtype is None:
                    part = loss_fn(model(xb), yb) if loss_fn is not model_loss else model_loss(model, xb, yb)
                else:
                    with _autocast(device, dtype):
                        part = loss_fn(model(xb), yb) if loss_fn is not model_loss else model_loss(model, xb, yb)
                if summed:
                    part = part * n  # the micro-batch's sum; Totals divides by all records later
                else:
                    n_all = known if known is not None else local if count is None else count.value
                    if n != n_all:
                        part = part * (n / n_all)
                value = part if value is None else value.detach() + part.detach()
            elif sharded or (ddp and i == last):
                # every rank's forward and backward take part in FSDP's and DDP's collectives
                part = _idle(ctx, model, xb, yb, loss_fn)
            else:
                continue  # an empty slice of a short global batch contributes nothing
            if replicas and i == last:  # after the forward: every rank's collectives in one order
                totals = Totals(ctx, _zero(value, device), local if summed else None)
                if carrier is not None:
                    carrier.pending = totals.vector
            if ddp and i == last:  # DDP's hook sums this backward, with the totals
                carrier.weighted, carrier.finished = True, False
                try:
                    (part if scaler is None else scaler.scale(part)).backward()
                finally:
                    carrier.weighted = False
            else:
                (part if scaler is None else scaler.scale(part)).backward()
    value = _zero(value, device)
    if totals is None and replicas:  # no micro-batch ran a backward here (an empty slice)
        totals = Totals(ctx, value, local if summed else None)
    # The optimizer's parameters: reduced over replicas without DDP or FSDP, divided by
    # the records after a summed step, and clipped when the model is no Module (a Module
    # is clipped in model.parameters() order, below).
    module = isinstance(model, nn.Module)
    unheld = replicas and carrier is None and not sharded
    wanted = unheld or summed or (clip_grad_norm is not None and not module)
    params = _trained_params(opt) if wanted else None
    total = known if known is not None else local if count is None else count.value
    if not summed and not total:  # after the backward: all ranks raise
        raise _empty_batch()
    mean = None
    if replicas:
        if ddp:
            if not carrier.finished:  # a bucket never became ready: a parameter got no gradient
                raise _unused_parameters()
            sparse = sparse_params(model)
            if sparse:  # left out of DDP's dense buckets: their rows are gathered here
                allreduce_sparse(comm_device(ctx), [p for p in model.parameters() if id(p) in sparse])
            carried = carrier.take()
        elif unheld:
            carried = allreduce_grads(ctx, params, totals.vector, sparse_params(model))
        else:  # FSDP has summed the gradients into each rank's shards already
            carried = None if carrier is None else carrier.take()
        mean = totals.finish(ctx, carried, params if summed else [])
    if scaler is not None:
        scaler.unscale_(opt)
    return value, mean, scaler, params


def _idle(ctx: OpContext, model: Any, x: Any, y: Any, loss_fn: Any) -> torch.Tensor:
    """A zero through every parameter, for a rank's empty slice of a global batch: the
    sum of the predictions (with `loss: model`, of the logits; the loss of no records is
    NaN) times 0. A model that cannot run an empty batch (a Hugging Face model's reshape)
    is told how to avoid one."""
    try:
        if loss_fn is not model_loss:
            return model(x).sum() * 0.0
        logits, part = forward(model_loss, model, x, y)
    except (RuntimeError, ValueError, IndexError) as e:
        raise RunError(
            f"train.step: replica rank {ctx.rank} has no records of this global batch (the last of "
            f"a pass, smaller than the {ctx.world_size} replicas), and the model cannot run the empty "
            f"batch its collectives need: {type(e).__name__}: {e}",
            hint="give the reader `drop_last: true`, or a batch_size whose last batch leaves every "
                 "replica a record") from e
    return (part if logits is None else logits).sum() * 0.0


def _empty_batch() -> RunError:
    return RunError(
        "train.step got an empty batch",
        hint="check `done` from `read` before training on its fields",
    )


def _unused_parameters() -> RunError:
    """DDP reduces its buckets in order: the last one's hook never ran when some parameter
    of the model got no gradient in the backward (every rank runs the same model)."""
    return RunError(
        "train.step: some parameters of the model got no gradient in this step; with "
        "replicas every parameter must (DDP all-reduces each one in every backward)",
        hint="use every parameter in the forward, or set requires_grad=False on those that "
             "are not trained (see docs/data-parallel.md)",
    )


_last_loss: list[Any] = [None]
IGNORE_INDEX = -100  # a label position no loss or accuracy counts (F.cross_entropy's default)


def _zero(value: Any, device: str) -> torch.Tensor:
    """The loss so far; zero when no micro-batch had records."""
    return torch.zeros((), device=device) if value is None else value


_AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def amp_dtype(amp: str, op: str = "train.step") -> torch.dtype:
    if amp not in _AMP:
        raise RunError(f"{op}: unknown amp {amp!r}", hint="amp is null, bf16 or fp16")
    return _AMP[amp]


def _autocast(device: str, dtype: torch.dtype) -> Any:
    return torch.autocast(torch.device(device).type, dtype=dtype)


# The fp16 loss scaler's state (scale, growth tracker, factors) lives in the optimizer's
# first param group under this key: torch's Optimizer.state_dict() saves param groups and
# load_state_dict() restores them, so a checkpoint of the optimizer holds the scaler too,
# whoever built the optimizer, and `ckpt show` shows it.
SCALER_KEY = "jobrun_grad_scaler"


def _scaler(opt: Any, device: str) -> Any:
    """The optimizer's GradScaler: made on the first fp16 step, from the state its param
    group holds after a resume."""
    scaler = getattr(opt, "_jobrun_scaler", None)
    if scaler is None:
        scaler = torch.amp.GradScaler(torch.device(device).type)
        saved = opt.param_groups[0].get(SCALER_KEY)
        if saved:
            scaler.load_state_dict(saved)
        opt._jobrun_scaler = scaler
        # Read only when the optimizer is saved, not at every step (get_scale() waits for
        # the device).
        opt.register_state_dict_pre_hook(_keep_scaler_state)
    return scaler


def _keep_scaler_state(opt: Any) -> None:
    opt.param_groups[0][SCALER_KEY] = opt._jobrun_scaler.state_dict()


def _dict_batch(x: Any, y: Any, device: str, loss_fn: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """A dict batch (the model's keyword arguments, `model(**batch)`) on the run's device,
    and the tensor that counts its records (:func:`jobrun.ops.batches.counter`), which
    carries the reader's tag of the global batch (see :func:`jobrun.ops.reader.mark_records`)."""
    if not isinstance(x, Mapping):
        if x is None:
            as_tensor(x, device, "train.step input batch")  # the error of a finished read
        raise RunError(
            f"train.step with 3 inputs trains on one dict batch, model(**batch); its third "
            f"input is a {type(x).__name__}, not a mapping",
            hint="read a reader with keys (keys: [input_ids, labels]) or over a Dataset whose "
            "items are dicts, or give the targets too: in: [model, opt, xb, yb]",
        )
    if loss_fn is not model_loss:
        raise RunError(
            "train.step: a dict batch needs `loss: model`: the model is called as "
            "model(**batch) and computes its loss (a loss function takes (output, target))",
            hint="add `loss: model`, or read a reader over (x, y) fields",
        )
    if y is not _ONE_BATCH:
        raise RunError(
            f"train.step: x is a dict batch (the model's keyword arguments) and y a "
            f"{type(y).__name__} besides; a dict batch holds its targets (`labels`)",
            hint="in: [model, opt, batch] with `loss: model`",
        )
    batch = batch_on(x, device, "train.step")
    first = counter(batch)
    if not isinstance(first, _Tensor):
        raise RunError(
            f"train.step: a dict batch's records are counted by its first tensor of records; "
            f"its values are {', '.join(f'{k}: {type(v).__name__}' for k, v in batch.items()) or 'none'}",
            hint="its values are the model's arguments: tensors of one record per row",
        )
    return batch, first


def batch_on(batch: Mapping, device: str, op: str) -> dict[str, Any]:
    """A dict batch with its tensors on `device`; other values (a list of strings, a
    flag) are the model's as they are."""
    return {k: as_tensor(v, device, f"{op} input {k}") if isinstance(v, _Tensor) else v
            for k, v in batch.items()}


def _micro_batches(x: Any, y: torch.Tensor, accumulate: int) -> list[tuple]:
    """`accumulate` (> 1) slices of a batch of records: (x, y, records) each. A dict
    batch x is sliced tensor by tensor (y is its first tensor)."""
    named = x.items() if isinstance(x, Mapping) else (("x", x),)
    for key, value in named:
        if isinstance(value, _Tensor) and (not value.dim() or value.shape[0] != y.shape[0]):
            raise RunError(
                f"train.step: {key} has {value.shape[0] if value.dim() else 'no'} records, "
                f"{'the first tensor' if isinstance(x, Mapping) else 'y'} has {y.shape[0]}",
                hint="accumulate splits the first dimension of every tensor of the batch; they must agree",
            )
    ys = y.tensor_split(accumulate)
    if isinstance(x, Mapping):
        parts = {k: v.tensor_split(accumulate) if isinstance(v, _Tensor) else None for k, v in x.items()}
        return [({k: x[k] if p is None else p[i] for k, p in parts.items()}, yb, yb.shape[0])
                for i, yb in enumerate(ys)]
    return [(xb, yb, yb.shape[0]) for xb, yb in zip(x.tensor_split(accumulate), ys)]


def _trained_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


# -------------------------------------------------------------------------- evaluate


def _count(y: torch.Tensor) -> int:
    """Records in a batch; an unbatched record (a 0-d label) counts as one."""
    return int(y.shape[0]) if y.dim() > 0 else 1


def evaluate(
    ctx: OpContext, model: Any, reader: Reader, *, loss: str = "cross_entropy",
    amp: str | None = None, batches: int | None = None,
) -> tuple[float, float | None]:
    """`evaluate`: mean loss and accuracy over one full pass, reduced over ranks.

    Accuracy is computed when the labels are class indices (integers, or cross_entropy
    with one dimension less than the predictions); it is None otherwise (regression).
    ``amp`` autocasts each forward and loss as `train.step`'s does. ``batches`` N: the
    reader's next N batches instead (read as `read` reads them, moving its position), and
    the loss is the mean of the N batch losses, as a hand loop's estimate (nanoGPT's
    estimate_loss: float32 losses, their torch mean), each batch's loss the mean over its
    global batch.
    """
    if not isinstance(reader, Reader):
        raise RunError(f"evaluate expects a reader, got {a_type(reader)}")
    if reader.field_count == 1 and loss != MODEL:  # a Dataset reader learns its count late
        if getattr(reader, "keys", None):
            raise RunError("evaluate: a reader with keys gives dict batches, model(**batch), "
                           "which need `loss: model`", hint="add `loss: model`, or drop the reader's keys")
        raise RunError("evaluate needs a reader over (x, y)", hint="reader: {in: [x, y]}")
    if batches is not None:
        require_int("evaluate", "batches", batches, 1)
    loss_fn = _loss_fn(loss, "evaluate")
    cast = contextlib.nullcontext() if amp is None else _autocast(ctx.device, amp_dtype(amp, "evaluate"))
    was_training = getattr(model, "training", False)
    if isinstance(model, nn.Module):
        model.eval()
    try:
        with torch.no_grad(), cast:
            passes = reader.full_pass() if batches is None else _next_batches(reader, batches)
            sums = _eval_sums(ctx, model, loss_fn, loss, passes, _on_host(ctx), batches is not None)
    finally:
        if isinstance(model, nn.Module):
            model.train(was_training)
    loss_sum, count, correct, classified, *each = _reduce_sums(ctx, sums)
    if count == 0:
        raise RunError("evaluate: the reader has no records", hint="check the eval data")
    if batches is not None:  # the mean of the batch means, in float32 as a hand loop's
        means = torch.tensor([s / n for s, n in zip(each[::2], each[1::2]) if n], dtype=torch.float32)
        return means.mean().item(), (correct / classified if classified > 0 else None)
    # Accuracy per label: for sequence outputs every position is one prediction.
    return loss_sum / count, (correct / classified if classified > 0 else None)


def _on_host(ctx: OpContext) -> bool:
    return ctx.device == "cpu" or torch.device(ctx.device).type == "cpu"


def _next_batches(reader: Reader, n: int) -> Iterator[tuple[Any, ...]]:
    """The reader's next `n` batches, read as `read` reads them (ends of passes skipped)."""
    got = ends = 0
    while got < n:
        with reader.lock:
            counted = reader.tally[:2]
            *fields, done = reader.read()
            reader.tally[:2] = counted  # evaluation is not the throughput feed's: samples/s are training's
        if done:
            ends += 1
            if reader.finished or ends > 1 and got == 0:
                raise RunError(
                    f"evaluate: the reader ran out after {got} of {n} batches",
                    hint="give the reader passes: 0 (forever), or ask for fewer batches",
                )
            continue
        got += 1
        yield tuple(fields)


def _eval_sums(ctx, model, loss_fn, loss: str, passes: Iterable[tuple], host: bool,
               each: bool = False) -> list[Any]:
    """[sum of loss * count, count, correct labels, labels compared] over the batches;
    ``each``: then every batch's loss * count and count.

    Float64 sums, added batch by batch in order. On the CPU they are Python floats and
    ints (the same IEEE double arithmetic as float64 tensors, without three tensor ops
    per indexed in-place add); elsewhere 0-d device tensors, so that the loop never waits
    for the device.
    """
    loss_sum: Any = 0.0
    count = classified = 0
    correct: Any = 0
    per_batch: list[Any] = []
    for fields in passes:
        x, y, n = _eval_batch(ctx, fields, loss)
        if n == 0:
            if each:  # a rank's empty slice of a global batch: the others have its records
                per_batch += [0.0, 0]
            continue
        pred, part = forward(loss_fn, model, x, y)
        weighted = (part.item() if host else part.double()) * n
        loss_sum = loss_sum + weighted
        if each:
            per_batch += [weighted, n]
        count += n
        pair = _compared(model, pred, x, y, loss)
        if pair is not None:
            guess, labels = pair
            labels = labels if labels.dtype == torch.long else labels.long()
            hits = (guess.argmax(dim=-1) == labels).sum()  # an ignored label (-100) is never hit
            scored = (labels != IGNORE_INDEX).sum()  # cross_entropy's and Hugging Face's ignored labels
            correct = correct + (int(hits) if host else hits)
            classified = classified + (int(scored) if host else scored)
    return [loss_sum, count, correct, classified, *per_batch]


def _eval_batch(ctx: OpContext, fields: tuple, loss: str) -> tuple[Any, Any, int]:
    """(x, y, records) of one batch on the run's device. With `loss: model` a batch may be
    one mapping (its keys are the model's arguments) and y is None."""
    first = fields[0] if fields else None
    if loss == MODEL and isinstance(first, Mapping):
        x = batch_on(first, ctx.device, "evaluate")
        y = as_tensor(fields[1], ctx.device, "evaluate input y") if len(fields) > 1 else None
        return x, y, _count(y) if y is not None else records(x)
    if len(fields) < 2:
        raise RunError("evaluate needs a reader over (x, y)", hint="a sample is a tuple (x, y)")
    x = as_tensor(fields[0], ctx.device, "evaluate input x")
    y = as_tensor(fields[1], ctx.device, "evaluate input y")
    return x, y, _count(y)


def _compared(model: Any, pred: Any, x: Any, y: Any, loss: str) -> tuple[Any, Any] | None:
    """(predictions, labels) that accuracy compares, or None (regression, no logits)."""
    if loss == MODEL:
        labels = x.get("labels") if y is None and isinstance(x, Mapping) else y
        return None if pred is None else accuracy_logits(model, pred, labels)
    labels = not y.is_floating_point() or loss == "cross_entropy"
    return (pred, y) if labels and pred.dim() == y.dim() + 1 else None


def _reduce_sums(ctx: OpContext, sums: list[Any]) -> list[float]:
    """The sums as floats, summed over ranks (one collective)."""
    if not ctx.distributed:
        return [float(v) for v in sums]
    dev = comm_device(ctx)
    reduced = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(dev) for v in sums])
    torch.distributed.all_reduce(reduced)
    return reduced.tolist()


