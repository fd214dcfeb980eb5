"""`parallel: fsdp`: models sharded over the replicas with FSDP2 (``fully_shard``).

Each rank holds a shard (dim 0) of every parameter, its gradient and its optimizer
state; a forward gathers a layer's parameters just before it and frees them after. The
layers are the model's direct children that hold parameters (the blocks of a ModuleList
each), then the root. Sharding happens when the model is built (after rank 0's
parameters are broadcast, so every rank starts equal) and before the optimizer is made
over it, so the optimizer's state is sharded too. With one replica nothing is sharded.

Gradients are averaged over ranks, as DDP's default (a plain SUM, then divided by the
number of ranks): a `call`'s step, whose loss is its rank's mean, trains as under ddp.
`train.step` weights each rank's loss by its share of the global batch, the same code as
for ddp, and sums its backwards (a divide factor of 1, :func:`jobrun.ops.dist.fsdp_sums`),
so fsdp and ddp compute the same update. The step's totals (the ranks' losses,
see :class:`jobrun.ops.dist.Totals`) ride in the first reduce-scatter of its last
backward (:class:`StepTotals`) instead of a collective of their own, and stay on the
device; the stop flags are agreed as for ddp (:class:`jobrun.ops.dist.StopFlags`).

With an amp (the plan's, see :mod:`jobrun.plans.precision`) the parameters are gathered
and used in bf16/fp16 (MixedPrecisionPolicy), gradients reduced in float32 and the
model's output given back in float32, so that losses are computed as autocast computes
them; the sharded parameters and the optimizer stay float32. Autocast (`train.step`'s
amp) still applies: it keeps the operations it runs in float32 there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from jobrun.errors import RunError
from jobrun.ops.imports import resolve
from jobrun.ops.train import amp_dtype


def shard(module: nn.Module, types: tuple[str, ...] = (), amp: str | None = None) -> nn.Module:
    """Shard ``module`` in place: its layers (see :func:`layers`; with ``types``, the
    plan's `fsdp_layers`: every submodule of those classes), then the root; with ``amp``
    (bf16, fp16) parameters are gathered in that dtype."""
    # The mesh is on the module's device. fully_shard's default mesh is on the machine's
    # accelerator whenever it has one: CPU ranks on a host with one GPU all called
    # cuda.set_device(rank) there, and rank 1 failed ("invalid device ordinal").
    device = next(iter(module.parameters()), torch.empty(0)).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units = layers_of_types(module, types) if types else layers(module)
    for layer in untied(module, units):
        fully_shard(layer, mesh=mesh, mp_policy=policy(amp, root=False))
    fully_shard(module, mesh=mesh, mp_policy=policy(amp, root=True))
    totals = StepTotals() if hasattr(FSDPModule, "set_custom_reduce_scatter") else None
    module._jobrun_units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in module._jobrun_units:
        # A plain SUM (gloo has no PREMUL_SUM; NCCL sums the same way), then the division
        # by the ranks of DDP's default: a `call`'s backward gets the ranks' mean
        # (train.step sums its weighted ones: dist.fsdp_sums).
        m.set_gradient_divide_factor(float(dist.get_world_size()))
        m.set_force_sum_reduction_for_comms(True)
        if totals is not None:
            m.set_custom_reduce_scatter(totals)
    module._jobrun_totals = totals  # train.step finds it here (see dist.Totals)
    return module


class StepTotals:
    """FSDP's reduce-scatter of gradients (the same call as its default), which also
    carries the vector that `train.step` hands it (``pending``, a
    :class:`jobrun.ops.dist.Totals` vector): the first reduce-scatter after that, in
    float32 or float64, appends the vector to every rank's chunk of its input, so that
    each rank's output ends with the vector summed over ranks (``carried``), on the
    device. One collective fewer per step: on 2 gloo ranks a separate
    all-reduce of those few numbers cost 3% of the benchmark's steps.

    FSDP calls it as its ReduceScatter comm (``allocate``, then the call), on every rank
    in the same order, so every rank carries the vector in the same collective or none.
    """

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None
        self.carried: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        extra = self.pending
        if extra is None or input_tensor.dtype not in _CARRIERS or op != dist.ReduceOp.SUM or async_op:
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.pending = None
        n, k = output_tensor.numel(), extra.numel()
        rows = torch.empty((group.size(), n + k), dtype=input_tensor.dtype, device=input_tensor.device)
        rows[:, :n] = input_tensor.view(group.size(), n)
        rows[:, n:] = extra
        out = torch.empty(n + k, dtype=input_tensor.dtype, device=input_tensor.device)
        _reduce_scatter(out, rows.view(-1), op=op, group=group)
        output_tensor.copy_(out[:n])
        self.carried = out[n:]
        return None

    def take(self) -> torch.Tensor | None:
        """The summed vector if a reduce-scatter carried it (None otherwise); clears both."""
        carried, self.carried, self.pending = self.carried, None, None
        return carried


_CARRIERS = (torch.float32, torch.float64)
# FSDP's default comm calls reduce_scatter_single where torch has it (2.13 deprecates
# reduce_scatter_tensor with a warning); the two take the same arguments.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def policy(amp: str | None, root: bool) -> MixedPrecisionPolicy:
    """FSDP's mixed precision for ``amp``: parameters in its dtype, gradients reduced in
    float32, and the root's output in float32 (a loss computed outside autocast, as in
    `evaluate` without amp, is computed in float32)."""
    if amp is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=amp_dtype(amp), reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def layers(module: nn.Module) -> list[nn.Module]:
    """The units FSDP gathers one at a time: each direct child that holds parameters;
    a container without a forward of its own (ModuleList, ModuleDict: a transformer's
    blocks) stands for its children."""
    out = []
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            out += layers(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


def untied(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``units`` less those that share a parameter with another unit or with the root's
    own (tied weights: a Hugging Face LM's head is its input embedding): FSDP manages a
    parameter in one unit only, and refuses the model at its first forward otherwise.
    Their parameters are gathered with the root's instead (once per step)."""
    units = list(units)
    while True:
        index = {id(u): i for i, u in enumerate(units)}
        owners: dict[int, set[int]] = {}  # parameter -> the units holding it (-1: the root)
        for name, p in root.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), set()).add(_owner(root, name, index))
        tied = {u for held in owners.values() if len(held) > 1 for u in held if u >= 0}
        if not tied:
            return units
        units = [u for i, u in enumerate(units) if i not in tied]


def _owner(root: nn.Module, name: str, index: dict[int, int]) -> int:
    """The index of the innermost unit on the path of parameter ``name`` (-1: none, the
    root's own)."""
    found, module = -1, root
    for part in name.split(".")[:-1]:
        module = module.get_submodule(part)
        found = index.get(id(module), found)
    return found


def layers_of_types(module: nn.Module, types: tuple[str, ...]) -> list[nn.Module]:
    """Every submodule that is an instance of one of ``types`` (dotted class paths), the
    innermost first (FSDP shards a module's parts before the module)."""
    classes = []
    for path in types:
        cls = resolve(path, "fsdp_layers", "class")
        if not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise RunError(f"fsdp_layers: {path!r} is not a module class",
                           hint="name nn.Module subclasses, e.g. torch.nn.TransformerEncoderLayer")
        classes.append(cls)
    found = [m for m in module.modules() if m is not module and isinstance(m, tuple(classes))]
    if not found:
        kinds = sorted({type(m).__name__ for m in module.modules() if m is not module})
        raise RunError(f"fsdp_layers: the model has no {', '.join(types)}",
                       hint=f"its modules are: {', '.join(kinds) or 'none'}")
    return found[::-1]


def is_sharded(model: Any) -> bool:
    return isinstance(model, FSDPModule)


def gathered(values: tuple[Any, ...], rank: int) -> tuple[Any, ...]:
    """``values`` with each sharded model replaced by its whole state dict (on rank 0)."""
    return tuple(full_state(v, rank) if is_sharded(v) else v for v in values)


def full_state(model: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """The whole state dict as CPU tensors on rank 0 (None elsewhere): every rank takes
    part in gathering each sharded tensor."""
    out = {}
    for key, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if rank == 0:
            out[key] = full.detach().to("cpu", copy=True)
    return out if rank == 0 else None
