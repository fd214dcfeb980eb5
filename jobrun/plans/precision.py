"""The precision FSDP gathers parameters in: `parallel: fsdp` follows `train.step`'s `amp`.

FSDP2 fixes, when it shards a model (at `model.mlp` or `build`, long before the first
`train.step` runs), the dtype in which the model's parameters are gathered and computed
(its MixedPrecisionPolicy). A plan states that dtype where it states mixed precision: in
`train.step`'s `amp`. When every `train.step` of the plan has the same `amp`, models are
sharded with parameters gathered in that dtype and gradients reduced in float32; when
they disagree (or none has `amp`), parameters are gathered in float32 and each step
autocasts as it says. Worked out from the plan alone, so that every rank decides the same
and `print`/`analyze` can tell before the job runs.
"""

from __future__ import annotations

from jobrun.errors import Pos
from jobrun.plans import ir
from jobrun.plans.visit import Visitor


class _TrainSteps(Visitor):
    def __init__(self) -> None:
        self.found: list[tuple[str | None, Pos]] = []

    def visit_OpCall(self, call: ir.OpCall) -> None:
        if call.op == "train.step":
            self.found.append((call.kwargs.get("amp"), call.pos))


def train_amps(plan: ir.Plan) -> list[tuple[str | None, Pos]]:
    """(amp, position) of every `train.step` call, in plan order."""
    walk = _TrainSteps()
    walk.visit(plan)
    return walk.found


def fsdp_amp(plan: ir.Plan) -> str | None:
    """The dtype (bf16, fp16) fsdp gathers parameters in, or None for float32."""
    if plan.parallel != "fsdp":
        return None
    amps = {amp for amp, _ in train_amps(plan)}
    return amps.pop() if len(amps) == 1 else None


def problems(plan: ir.Plan) -> list[tuple[str, Pos, str, str]]:
    """(code, pos, message, hint) of each warning: under fsdp, `train.step` calls that
    disagree on `amp`; without it, `fsdp_layers`, which then does nothing."""
    if plan.parallel != "fsdp":
        return [("fsdp-layers", plan.fsdp_layers_pos or plan.pos,
                 "fsdp_layers does nothing without `parallel: fsdp`: no model is sharded",
                 "add `parallel: fsdp`, or remove fsdp_layers")] if plan.fsdp_layers else []
    steps = train_amps(plan)
    if len({amp for amp, _ in steps}) < 2:
        return []
    first_amp, first = steps[0]
    other_amp, other = next((amp, pos) for amp, pos in steps if amp != first_amp)
    return [(
        "fsdp-amp", other,
        f"under parallel: fsdp this train.step has amp {other_amp or 'null'}, the one at line "
        f"{first.line} has {first_amp or 'null'}: parameters are gathered in float32",
        "give every train.step the same amp to gather parameters in bf16/fp16 "
        "(FSDP fixes the dtype when it shards the model)",
    )]
