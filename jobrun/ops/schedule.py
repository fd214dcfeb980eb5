"""`scheduler` without a `target`: a learning rate computed in closed form from the step.

    lr(step) = base * (step + 1) / (warmup + 1)              step < warmup
             = min_lr                                        step > steps
             = min_lr + coeff * (base - min_lr)              otherwise, with
    ratio = (step - warmup) / (steps - warmup) and coeff = 0.5 * (1 + cos(pi * ratio))
    (cosine), 1 - ratio (linear) or 1 (constant)

as nanoGPT's `get_lr` computes it, operation for operation, so a plan and a hand loop
that uses it get the same float. `base` is each parameter group's learning rate as the
optimizer was made (kept as the group's `initial_lr`, torch's own key); `min_lr` is given,
or `min_ratio` times `base`.

The schedule attaches to its optimizer (a step pre-hook: `register_step_pre_hook`), so
every optimizer step, `train.step`'s or a `call`'s, runs at the learning rate of the global
step it takes (the steps taken before it, `OpContext.step`). No state accumulates: a resume
restores the global step and the next step's rate follows from it, with no recursive drift
as chained `LinearLR`/`CosineAnnealingLR` have.
"""

from __future__ import annotations

import math
from typing import Any

from jobrun.errors import RunError, did_you_mean
from jobrun.ops.context import OpContext

DECAYS = ("cosine", "linear", "constant")
SCHEDULE_ARGS = ("warmup", "decay", "steps", "min_lr", "min_ratio")  # without a target


class StepSchedule:
    """The learning rate of every param group of `opt` as a function of the global step."""

    def __init__(self, ctx: OpContext, opt: Any, *, warmup: int, decay: str, steps: int | None,
                 min_lr: float | None, min_ratio: float) -> None:
        self.ctx = ctx
        self.opt = opt
        self.warmup, self.decay, self.steps = warmup, decay, steps
        self.min_lr, self.min_ratio = min_lr, min_ratio
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self._hook = opt.register_step_pre_hook(lambda *_: self.apply(self.ctx.step))
        self.apply(ctx.step)  # a `log` of the rate before the first step reads the first one

    def lr(self, base: float, step: int) -> float:
        """The rate of a group whose peak rate is `base`, at `step` (nanoGPT's get_lr)."""
        if step < self.warmup:
            return base * (step + 1) / (self.warmup + 1)
        if self.decay == "constant":
            return base
        min_lr = self.min_lr if self.min_lr is not None else base * self.min_ratio
        if step > self.steps:  # type: ignore[operator]
            return min_lr
        ratio = (step - self.warmup) / (self.steps - self.warmup)  # type: ignore[operator]
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) if self.decay == "cosine" else 1.0 - ratio
        return min_lr + coeff * (base - min_lr)

    def apply(self, step: int) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.lr(group["initial_lr"], step)

    def get_last_lr(self) -> list[float]:
        """The rates set last, one a group (as torch's schedulers name it)."""
        return [group["lr"] for group in self.opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The formula: all there is (the step is the runner's, in every checkpoint)."""
        return {"warmup": self.warmup, "decay": self.decay, "steps": self.steps,
                "min_lr": self.min_lr, "min_ratio": self.min_ratio}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != self.state_dict():
            raise RunError(f"the checkpoint's schedule {state} is not this plan's {self.state_dict()}",
                           hint="resume with the schedule the run started with")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.state_dict().items())
        return f"StepSchedule({args})"


def problem(schedule: dict[str, Any], others: dict[str, Any]) -> tuple[str, str, str | None] | None:
    """Why a schedule without a target cannot run, as (the key at fault, message, hint),
    else None. `analyze` asks it before the run (jobrun.plans.signatures), the op when
    it is made: one rule for both."""
    warmup, decay, steps = schedule["warmup"], schedule["decay"], schedule["steps"]
    if others:
        first = sorted(others)[0]
        guess = did_you_mean(first, [*SCHEDULE_ARGS, "target"])
        return first, (
            f"scheduler: {', '.join(sorted(others))} need(s) a `target` (a torch scheduler class); "
            "a schedule without one takes warmup, decay, steps, min_lr or min_ratio"), (
            guess or "add e.g. target: torch.optim.lr_scheduler.StepLR, or remove those keys")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        return "warmup", f"scheduler: warmup must be a whole number of steps >= 0, got {warmup!r}", None
    if decay not in DECAYS:
        return "decay", f"scheduler: unknown decay {decay!r}", f"one of {', '.join(DECAYS)}"
    if decay != "constant" and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= warmup):
        got = "it is not given" if steps is None else f"got {steps!r}"
        return "steps", (
            f"scheduler: steps (where the {decay} decay ends) must be a whole number above "
            f"warmup ({warmup}); {got}"), "e.g. steps: 5000 with warmup: 100, or decay: constant"
    for name in ("min_lr", "min_ratio"):
        value = schedule[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
            return name, f"scheduler: {name} must be a number >= 0, got {value!r}", None
    return None


def beside_target(given: list[str], target: str) -> tuple[str, str, str] | None:
    """Why a scheduler with a `target` cannot take the schedule's own keys `given` (those
    the plan gave), as (the first key, message, hint), else None: the op keeps them for
    the schedule without a target and never passes them on, so a class of yours that takes
    `warmup` would silently get its own default. `analyze` asks it with the keys the plan
    gives, the op with those it got unlike their defaults."""
    if not given:
        return None
    keys = sorted(given)
    return keys[0], (
        f"scheduler: {', '.join(keys)} belong(s) to the schedule without a target, not to "
        f"{target}: jobrun does not pass them on"), (
        "remove `target` to schedule by the global step, or give your scheduler's argument "
        "another name (e.g. warmup_steps)")


def closed_form(ctx: OpContext, opt: Any, schedule: dict[str, Any], others: dict[str, Any]) -> StepSchedule:
    """`scheduler` without a target: check the arguments, attach the schedule to `opt`;
    `others` are keys the plan gave beside the schedule's own (a torch scheduler's)."""
    found = problem(schedule, others)
    if found is not None:
        raise RunError(found[1], hint=found[2])
    warmup, decay, steps = schedule["warmup"], schedule["decay"], schedule["steps"]
    min_lr, min_ratio = schedule["min_lr"], schedule["min_ratio"]
    return StepSchedule(ctx, opt, warmup=warmup, decay=decay, steps=steps,
                        min_lr=None if min_lr is None else float(min_lr), min_ratio=float(min_ratio))
