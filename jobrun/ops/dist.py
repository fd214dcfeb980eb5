"""Data parallelism: the collectives the training ops share, and the `dist.*` ops.

With ``ctx.world_size = R > 1`` the runner has initialised torch.distributed (gloo on
CPU, nccl on CUDA) and every rank runs the same ops on its own slice of each global batch
(see :mod:`jobrun.ops.reader`). The ops keep ranks identical: models are built from the
node's seeded generator and broadcast from rank 0 (:mod:`jobrun.ops.models`), then made
data parallel by torch's DDP (:func:`replicate_module`), whose hooks all-reduce gradients
during every backward; ``train.step`` weights each rank's loss by its share of the global
batch, and ``evaluate`` reduces its sums over ranks (:mod:`jobrun.ops.train`). Every collective is
issued by every rank in the same order, also by a rank whose slice is empty.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from jobrun import signals
from jobrun.errors import RunError, a_type
from jobrun.ops.context import OpContext


def comm_device(ctx: OpContext) -> torch.device:
    # nccl only moves CUDA tensors; gloo is used with CPU tensors.
    if torch.distributed.get_backend() == "nccl":
        return torch.device(ctx.device)
    return torch.device("cpu")


def broadcast_tensors(ctx: OpContext, tensors: Sequence[torch.Tensor], src: int) -> None:
    """Overwrite `tensors` in place with rank `src`'s values, in one collective: their
    bytes in one flat buffer, whatever their dtypes (BatchNorm's float32 statistics and
    int64 counter took two)."""
    if not tensors:
        return
    dev = comm_device(ctx)
    parts = [t.detach().reshape(-1).to(dev).view(torch.uint8) for t in tensors]
    flat = torch.cat(parts)
    torch.distributed.broadcast(flat, src=src)
    for t, chunk in zip(tensors, flat.split([part.numel() for part in parts])):
        # a copy of its own: a chunk's offset may not be a multiple of its dtype's size
        t.data.copy_(chunk.clone().view(t.dtype).view_as(t))


# ---------------------------------------------------------------- torch's DDP (replicate)


def replicate_module(ctx: OpContext, module: nn.Module) -> nn.Module:
    """Make ``module`` data parallel in place with torch's DDP (the composable
    ``replicate``: the module keeps its class, attributes and state-dict keys, so
    checkpoints and user code see the same model as with one process).

    DDP's bucketed hooks all-reduce gradients during every backward through the module,
    a `call` step's too. Its communication hook (:class:`Carrier`) averages them over the
    ranks, as DDP's default hook does, except in `train.step`'s backward, whose losses are
    weighted by each rank's share of the global batch already: there it sums them (the
    rounding of jobrun's own all-reduce before, see :func:`jobrun.ops.train.train_step`)
    and carries the step's loss in its first bucket. Modules with sparse gradients
    (``sparse=True``) are left out of DDP (its buckets are dense): `train.step` gathers
    their rows itself (:func:`allreduce_sparse`). Parameters and buffers were broadcast
    from rank 0 already (:mod:`jobrun.ops.models`), so DDP's initial sync is skipped.
    """
    from torch.distributed._composable.replicate import replicate

    ignored = [m for m in module.modules() if getattr(m, "sparse", False) is True]
    left_out = {id(p) for m in ignored for p in m.parameters()}
    if not any(p.requires_grad and id(p) not in left_out for p in module.parameters()):
        return module  # nothing dense to train: train.step reduces what there is itself
    dev = torch.device(ctx.device)
    kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
    # DDP broadcasts rank 0's buffers (BatchNorm statistics) before every forward, as
    # torch does by default, so that a `call` step's forward sees them too; train.step
    # broadcasts them once more after its optimizer step, so that evaluate (no forward
    # sync without gradients) and checkpoints see rank 0's.
    replicate(module, ignored_modules=ignored, init_sync=False, **kwargs)
    type(module).__deepcopy__ = _plain_copy  # replicate's refuses: an EMA's AveragedModel(model)
    carrier = Carrier(ctx.world_size)
    module.register_comm_hook(carrier, Carrier.hook)
    replicate.state(module).lazy_init()  # now, on every rank, not in some first forward
    module._jobrun_carrier = carrier
    params = [p for p in module.parameters() if id(p) not in left_out]
    module.register_forward_pre_hook(_TrainedAsBuilt(params))
    return module


class _TrainedAsBuilt:
    """DDP all-reduces the gradients of the parameters that required them when it was
    made, and only those: a parameter frozen later gets no gradient (DDP waits for it),
    one unfrozen later trains on each rank's own gradient, and the ranks drift apart
    without a word. So a forward that computes gradients checks, before it runs, that
    the parameters that require them are those of the build (one bool a parameter)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.built = [p.requires_grad for p in params]

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and [p.requires_grad for p in self.params] != self.built:
            raise self._changed(module)

    def _changed(self, module: nn.Module) -> RunError:
        names = {id(p): n for n, p in module.named_parameters()}
        frozen = [names[id(p)] for p, b in zip(self.params, self.built) if b and not p.requires_grad]
        thawed = [names[id(p)] for p, b in zip(self.params, self.built) if not b and p.requires_grad]
        said = [f"{what} {_some(which)}" for what, which in (("frozen", frozen), ("unfrozen", thawed)) if which]
        error = RunError(
            f"the model's trained parameters changed after it was built ({'; '.join(said)}): with "
            "replicas, torch's DDP all-reduces the gradients of the parameters that required "
            "them when the model was built, and only those, so the replicas would wait for "
            "gradients that never come or train apart",
            hint="with replicas, set requires_grad in the model's constructor (the `build` target) "
                 "and leave it: train a frozen part's epochs in a plan of their own and load its "
                 "weights in the next one's `build` (docs/data-parallel.md)",
        )
        error.every_rank = True  # every replica runs the plan's code that changed them
        return error


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _plain_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy`` of a module :func:`replicate_module` made data parallel: a copy of
    the module as it was built (its class, parameters and buffers), without DDP. torch
    refuses to copy the replicated module; user code copies it as it did with one process
    (an EMA: ``AveragedModel(model)``, ``copy.deepcopy(model)``), and the copy, updated
    alike on every rank, stays alike and all-reduces nothing."""
    import copy

    built = next(c for c in type(module).__mro__[1:] if c.__name__ != "DDP" and issubclass(c, nn.Module))
    plain = built.__new__(built)
    state = {k: v for k, v in module.__dict__.items()
             if not k.startswith("__composable_api_state_key") and k != "_jobrun_carrier"}
    for hooks in ("_forward_pre_hooks", "_forward_hooks"):  # DDP's, bound to its state, and ours
        state[hooks] = type(state[hooks])((k, h) for k, h in state[hooks].items()
                                          if type(getattr(h, "__self__", None)).__module__ != _REPLICATE
                                          and not isinstance(h, _TrainedAsBuilt))
    plain.__dict__.update(state)
    return copy.deepcopy(plain, memo)


_REPLICATE = "torch.distributed._composable.replicate"


def carrier_of(model: Any) -> Carrier | None:
    """The :class:`Carrier` of a module made data parallel by :func:`replicate_module`."""
    return getattr(model, "_jobrun_carrier", None)


class Carrier:
    """DDP's communication hook for a replicated module, and what it carries.

    Every bucket is all-reduced asynchronously (DDP overlaps that with the rest of the
    backward). Outside `train.step` (``weighted`` False) a bucket is divided by the world
    size first, exactly torch's default ``allreduce_hook``. In `train.step`'s backward
    (``weighted``) it is summed, and ``pending`` (the step's :class:`Totals` vector) rides
    at the end of the first float32/float64 bucket, so that the vector summed over ranks
    comes back in ``carried`` with the gradients, on the device, read by nobody until
    someone needs the loss: no collective of its own and no wait for the device. Every
    rank calls the hook for the same buckets in the same order, so all carry it or none.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.weighted = False
        self.pending: torch.Tensor | None = None
        self.carried: torch.Tensor | None = None
        self.finished = True  # the last bucket's hook ran (DDP reduces buckets in order)

    @staticmethod
    def hook(self, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP checks them against its own types, which this module's
        # postponed (string) annotations never equal.
        buf = bucket.buffer()
        extra = self.pending
        if bucket.is_last():
            self.finished = True
        if not self.weighted:
            buf.div_(self.world)
        elif extra is not None and buf.dtype in (torch.float32, torch.float64):
            self.pending = None
            n = buf.numel()
            flat = torch.cat([buf, extra.to(buf.dtype)])
            fut = torch.distributed.all_reduce(flat, async_op=True).get_future()
            return fut.then(lambda f: self._keep(f.value()[0], n))
        return torch.distributed.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    def _keep(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        self.carried = flat[n:]
        return flat[:n]

    def take(self) -> torch.Tensor | None:
        """The summed vector if a bucket carried it (None otherwise); clears both."""
        carried, self.carried, self.pending = self.carried, None, None
        return carried


@contextlib.contextmanager
def fsdp_sums(module: nn.Module) -> Iterator[None]:
    """`train.step`'s backwards through a model `parallel: fsdp` sharded: each rank's loss
    is weighted by its share of the global batch already, so FSDP sums the gradients over
    ranks, as the :class:`Carrier` does DDP's; every other backward (a `call`'s) gets their
    mean, as a hand-written DDP loop does (:func:`jobrun.ops.fsdp.shard`)."""
    units = module._jobrun_units
    for m in units:
        m.set_gradient_divide_factor(1.0)
    try:
        yield
    finally:
        for m in units:
            m.set_gradient_divide_factor(float(torch.distributed.get_world_size()))


class StopFlags:
    """The ranks' stop flags (a SIGINT/SIGTERM some rank got, see :mod:`jobrun.signals`),
    agreed on without waiting: each `train.step` of a replicated model starts an
    asynchronous all-reduce of this rank's flag and, first, reads the one the previous
    step started, which finished long ago. So a signal stops every rank at the same step,
    one step after it came, and no step waits for a collective of its own. The flag goes
    through CPU memory (a gloo group of its own when the job's backend is nccl), read
    through a numpy view: no read from the device either."""

    def __init__(self) -> None:
        self._work: Any = None
        self._group: Any = None
        self._world: Any = None
        self._buf = torch.zeros(1, dtype=torch.float64)
        self._view = self._buf.numpy()

    def exchange(self) -> None:
        world = torch.distributed.group.WORLD
        if world is not self._world:  # a new process group (tests run several jobs)
            self._work, self._world = None, world
            self._group = None if torch.distributed.get_backend() == "gloo" else \
                torch.distributed.new_group(backend="gloo")
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
            signals.agree(float(self._view[0]))
        self._view[0] = signals.flag()
        self._work = torch.distributed.all_reduce(self._buf, group=self._group, async_op=True)


stop_flags = StopFlags()


class GlobalCount:
    """The global batch size, all-reduced in the background while the forward runs: only
    for an fp16 step on a batch no reader split (see `train.step`), whose loss scaler must
    see the weighted loss, not the sum that :class:`Totals` divides after the backward."""

    def __init__(self, ctx: OpContext, local: int) -> None:
        self._value: int | None = None if ctx.distributed else local
        if ctx.distributed:
            self._tensor = torch.tensor([local], dtype=torch.int64, device=comm_device(ctx))
            self._work = torch.distributed.all_reduce(self._tensor, async_op=True)

    @property
    def value(self) -> int:
        if self._value is None:
            self._work.wait()
            self._value = int(self._tensor.item())
        return self._value


def allreduce_grads(ctx: OpContext, params: list[torch.Tensor], totals: torch.Tensor,
                    sparse: frozenset[int] = frozenset()) -> torch.Tensor:
    """Sum gradients (one flat bucket per dtype) and the step's :class:`Totals` vector
    over ranks, for a model that DDP does not hold (not a Module, or one made by user
    code rather than `build`); returns the summed vector, on the device.

    A rank whose slice was empty has no gradients; a per-parameter "has a gradient" flag
    rides in the float32 bucket with the totals, so that a parameter no rank touched keeps
    grad=None as in a single process (optimizers skip those), at no extra collective. The
    flags are read (from the device) only by a rank that lacks some gradient itself: where
    this rank has every one, so has the sum.

    ``sparse``: the ids of parameters whose gradients are sparse (see
    :func:`sparse_params`); their rows are gathered from every rank instead (see
    `allreduce_sparse`). Every rank must pass the same set, which is why it comes
    from the model's structure and not from the gradients one rank happens to have.
    """
    dev = comm_device(ctx)
    has = [p.grad is not None for p in params]
    meta = torch.cat([torch.tensor(has, dtype=torch.float32, device=dev), totals.float().to(dev)])
    reduced_meta = meta
    dense = [i for i, p in enumerate(params) if id(p) not in sparse] if sparse else range(len(params))
    groups: dict[torch.dtype, list[int]] = {}
    for i in dense:
        if has[i] and params[i].grad.is_sparse:
            raise RunError(
                f"train.step: a parameter of shape {tuple(params[i].shape)} got a sparse gradient, "
                "but its module is not marked sparse",
                hint="replicas gather sparse gradients of modules with `sparse=True` (nn.Embedding, "
                     "nn.EmbeddingBag); make the module one of those, or its gradient dense",
            )
        groups.setdefault(params[i].dtype, []).append(i)
    groups.setdefault(torch.float32, [])
    for dtype, idxs in groups.items():
        parts = [(params[i].grad if has[i] else torch.zeros_like(params[i])) for i in idxs]
        parts = [g.reshape(-1).to(dev) for g in parts]
        if dtype == torch.float32:
            parts.append(meta)
        flat = torch.cat(parts)
        torch.distributed.all_reduce(flat)
        _scatter_grads(params, idxs, flat)
        if dtype == torch.float32:
            reduced_meta = flat[flat.numel() - meta.numel() :]
    if sparse:
        allreduce_sparse(dev, [p for p in params if id(p) in sparse])
    if not all(has):  # some parameter had no gradient here: did any rank give it one?
        for p, flag in zip(params, reduced_meta[: len(params)].tolist()):
            if flag == 0:
                p.grad = None
    return reduced_meta[len(params) :]


class Totals:
    """What `train.step` sums over ranks besides the gradients, in one small vector that
    rides in a collective the step's last backward issues anyway: DDP's first bucket
    (:class:`Carrier`), FSDP's first reduce-scatter (:class:`jobrun.ops.fsdp.StepTotals`),
    or the flat bucket of :func:`allreduce_grads`. Only where none of them could carry it
    is it all-reduced on its own (:meth:`finish`).

    Each rank fills its own slots: its loss (already weighted by its share of the global
    batch, the same weighting for DDP and FSDP) and, for a batch no reader split (whose
    global size no rank knows), its records; so its loss is its sum over records and
    :meth:`finish` divides the gradients and the loss by the records of all ranks, on
    the device. Every slot is one rank's number plus zeros, exact in whatever order a
    collective adds (a reduce-scatter adds each rank's chunk in an order of its own), so
    every rank then sums the same numbers in the same order and gets the same loss. Nothing
    here reads the device."""

    def __init__(self, ctx: OpContext, loss: torch.Tensor, records: int | None) -> None:
        world, rank = ctx.world_size, ctx.rank
        vector = torch.zeros(world if records is None else 2 * world, dtype=torch.float32, device=loss.device)
        vector[rank] = loss.detach().reshape(())
        if records is not None:
            vector[world + rank] = records
        self.vector, self._world, self._summed = vector, world, records is not None

    def finish(self, ctx: OpContext, carried: torch.Tensor | None, params: list[torch.Tensor]) -> torch.Tensor:
        """The global batch's mean loss (a 0-d float32 tensor) from the ``carried`` vector
        (None: none carried it, so it is all-reduced here); for summed losses the
        gradients of ``params`` are divided by the records of all ranks first."""
        if carried is None:
            carried = self.vector.to(comm_device(ctx))
            torch.distributed.all_reduce(carried)
        world = self._world
        loss = carried[:world].float().sum()
        if not self._summed:
            return loss
        # All ranks empty (no records): zero gradients and a zero loss, as each rank's
        # empty slice gave, rather than 0/0.
        records = carried[world:].float().sum().clamp_min(1.0)
        dense, sparse = [], []
        for p in params:
            g = p.grad
            if g is not None:
                g = g.to_local() if hasattr(g, "to_local") else g  # FSDP's shards
                (sparse if g.is_sparse else dense).append(g)
        if dense:
            torch._foreach_div_(dense, records.to(dense[0].device))
        for g in sparse:
            g.div_(records.to(g.device))
        return loss / records


_sparse_cache: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def sparse_params(model: Any) -> frozenset[int]:
    """The ids of the parameters of a model's modules that make sparse gradients
    (`sparse=True`: nn.Embedding, nn.EmbeddingBag); empty for anything but a Module."""
    if not isinstance(model, nn.Module):
        return frozenset()
    found = _sparse_cache.get(model)
    if found is None:
        found = frozenset(id(p) for m in model.modules() if getattr(m, "sparse", False) is True
                          for p in m.parameters(recurse=False))
        _sparse_cache[model] = found
    return found


def allreduce_sparse(dev: torch.device, params: list[torch.Tensor]) -> None:
    """Sum sparse (row) gradients over ranks: every rank gathers the others' rows (indices
    and values, padded to the longest) and coalesces them, so that the gradient stays
    sparse for optimizers that need it (SparseAdam) and costs rows, not the whole table."""
    world = torch.distributed.get_world_size()
    grads = [_rows(p) for p in params]
    counts = torch.tensor([0 if g is None else g._nnz() for g in grads], dtype=torch.int64, device=dev)
    every = [torch.empty_like(counts) for _ in range(world)]
    torch.distributed.all_gather(every, counts)
    per_rank = torch.stack(every).tolist()  # [rank][param]
    for j, (p, g) in enumerate(zip(params, grads)):
        sizes = [row[j] for row in per_rank]
        longest = max(sizes)
        if longest == 0:
            continue  # no rank has rows: the "has a gradient" flags decide grad=None
        idx = torch.zeros((1, longest), dtype=torch.int64, device=dev)
        val = torch.zeros((longest, *p.shape[1:]), dtype=p.dtype, device=dev)
        if g is not None and g._nnz():
            idx[:, : g._nnz()] = g._indices().to(dev)
            val[: g._nnz()] = g._values().to(dev)
        idxs = [torch.empty_like(idx) for _ in range(world)]
        vals = [torch.empty_like(val) for _ in range(world)]
        torch.distributed.all_gather(idxs, idx)
        torch.distributed.all_gather(vals, val)
        summed = torch.sparse_coo_tensor(
            torch.cat([t[:, :n] for t, n in zip(idxs, sizes)], dim=1),
            torch.cat([t[:n] for t, n in zip(vals, sizes)]),
            p.shape,
        ).coalesce()
        p.grad = summed.to(p.device)


def _rows(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as coalesced sparse rows (sparse_dim 1), or None."""
    g = p.grad
    if g is None:
        return None
    if not g.is_sparse:
        return g.to_sparse(1)
    g = g.coalesce()
    return g if g.sparse_dim() == 1 else g.to_dense().to_sparse(1)


def _scatter_grads(params: list[torch.Tensor], idxs: list[int], flat: torch.Tensor) -> None:
    sizes = [params[i].numel() for i in idxs]
    for i, chunk in zip(idxs, flat[: sum(sizes)].split(sizes)):
        p = params[i]
        chunk = chunk.view_as(p).to(p.device)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)



_REDUCE_OPS = ("sum", "mean", "max", "min")


def dist_allreduce(ctx: OpContext, x: Any, *, op: str = "sum") -> Any:
    """`dist.allreduce`: x -> y over ranks (identity, up to `mean`, in one process)."""
    if op not in _REDUCE_OPS:
        raise RunError(f"dist.allreduce: unknown op {op!r}", hint=f"one of {_REDUCE_OPS}")
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        if ctx.distributed:
            t = y.to(comm_device(ctx))
            torch.distributed.all_reduce(t, op=_reduce_op("sum" if op == "mean" else op))
            y = t.to(x.device)
        return y / ctx.world_size if op == "mean" else y
    if isinstance(x, bool | int | float | np.number):
        value: Any = int(x) if isinstance(x, bool | np.integer) else x
        if ctx.distributed:
            kind = torch.int64 if isinstance(value, int) else torch.float64
            t = torch.tensor([value], dtype=kind, device=comm_device(ctx))
            torch.distributed.all_reduce(t, op=_reduce_op("sum" if op == "mean" else op))
            value = t.item()
        return value / ctx.world_size if op == "mean" else value
    raise RunError(f"dist.allreduce: cannot reduce a {type(x).__name__}; use tensors or numbers")


def _reduce_op(op: str) -> Any:
    ops = torch.distributed.ReduceOp
    return {"sum": ops.SUM, "max": ops.MAX, "min": ops.MIN}[op]


# Broadcast header: [kind, dtype code, ndim, dims...]; receivers need not know the shape.
_KINDS = {"unsupported": 0, "tensor": 1, "int": 2, "float": 3, "bool": 4}
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_MAX_DIMS = 8


def dist_broadcast(ctx: OpContext, x: Any, *, src: int = 0) -> Any:
    """`dist.broadcast`: x -> y, rank `src`'s value on every rank."""
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < ctx.world_size:
        raise RunError(f"dist.broadcast: src must be a rank in [0, {ctx.world_size}), got {src}")
    if not ctx.distributed:
        return x.detach().clone() if isinstance(x, torch.Tensor) else x
    dev = comm_device(ctx)
    header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=dev)
    if ctx.rank == src:
        header.copy_(_broadcast_header(x))
    torch.distributed.broadcast(header, src=src)
    kind, code, ndim, *dims = header.tolist()
    if kind == _KINDS["unsupported"]:
        raise RunError(
            f"dist.broadcast: rank {src} holds a value that cannot be broadcast",
            hint="broadcast tensors (up to 8 dimensions, plain dtypes) or numbers",
        )
    if kind == _KINDS["tensor"]:
        payload = x.detach().to(dev).clone() if ctx.rank == src else None
        if payload is None:
            payload = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=dev)
        torch.distributed.broadcast(payload, src=src)
        return payload.to(ctx.device)
    dtype = torch.float64 if kind == _KINDS["float"] else torch.int64
    payload = torch.tensor([x if ctx.rank == src else 0], dtype=dtype, device=dev)
    torch.distributed.broadcast(payload, src=src)
    value = payload.item()
    return bool(value) if kind == _KINDS["bool"] else value


def _broadcast_header(x: Any) -> torch.Tensor:
    header = [0] * (3 + _MAX_DIMS)
    if isinstance(x, torch.Tensor) and x.dtype in _DTYPES and x.dim() <= _MAX_DIMS:
        header[:3] = [_KINDS["tensor"], _DTYPES.index(x.dtype), x.dim()]
        header[3 : 3 + x.dim()] = list(x.shape)
    elif isinstance(x, bool):
        header[0] = _KINDS["bool"]
    elif isinstance(x, int):
        header[0] = _KINDS["int"]
    elif isinstance(x, float):
        header[0] = _KINDS["float"]
    return torch.tensor(header, dtype=torch.int64)


def model_gather(ctx: OpContext, model: Any) -> dict[str, torch.Tensor] | None:
    """`model.gather`: a CPU copy of the full state dict on rank 0, None elsewhere.

    With ddp the replicas hold identical full parameters, so no communication is
    needed; with fsdp every rank sends its shards (all ranks must run the op).
    """
    if not isinstance(model, nn.Module):
        raise RunError(f"model.gather expects an nn.Module, got {a_type(model)}")
    if ctx.parallel == "fsdp" and ctx.distributed:
        from jobrun.ops.fsdp import full_state

        return full_state(model, ctx.rank)  # every rank takes part
    if ctx.rank != 0:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
