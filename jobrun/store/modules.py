"""What a module's `state_dict` leaves out but training changes: its modes and frozen parameters.

A plan may freeze a backbone in `init` and unfreeze it in epoch 3, or keep a submodule in
eval mode. `state_dict()` holds neither (its tensors are detached, and `training` is not
state), and resume runs `init` again, which freezes the backbone again. So a module's
saved state carries, besides its state dict::

    {"training": bool,          the module's own mode
     "flipped": [names],        submodules whose mode differs from it
     "frozen": [names]}         parameters with requires_grad false

and restoring a module sets them back (the JSON of a checkpoint holds them).
"""

from __future__ import annotations

import sys
from typing import Any

from jobrun import records_schema
from jobrun.errors import CheckpointError


def _is_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # no module exists before torch is imported
    return torch is not None and isinstance(obj, torch.nn.Module)


def module_flags(obj: Any) -> dict[str, Any] | None:
    """The flags above for a torch module; None for anything else."""
    if not _is_module(obj):
        return None
    root = bool(obj.training)
    return {
        "training": root,
        "flipped": [name for name, m in obj.named_modules() if name and m.training != root],
        "frozen": [name for name, p in obj.named_parameters() if not p.requires_grad],
    }


def apply_module_flags(live: Any, flags: Any, type_name: str) -> None:
    """Set the modes and requires_grad of `live` as `flags` (from module_flags) say."""
    if not _is_module(live):
        return
    try:
        flags = records_schema.check(flags, records_schema.MODULE_FLAGS)
    except records_schema.Invalid as e:
        raise CheckpointError(f"the saved flags of a {type_name} are malformed: {e}",
                              hint="the checkpoint is corrupt; resume from another epoch") from None
    root = flags["training"]
    live.train(root)
    modules = dict(live.named_modules())
    for name in flags["flipped"]:
        if name not in modules:
            raise CheckpointError(f"the saved {type_name} has a submodule {name!r} that the "
                                  "module init built has not", hint="did the model change since the save?")
        modules[name].training = not root  # this module only: its children keep their own
    frozen = set(flags["frozen"])
    for name, p in live.named_parameters():
        p.requires_grad_(name not in frozen)
