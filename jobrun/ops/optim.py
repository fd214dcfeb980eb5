"""`optimizer`'s class by name and its parameter groups by rule.

    groups: [{ndim_below: 2, weight_decay: 0.0}]

puts the parameters with fewer than 2 dimensions (biases, norms' weights) in a group
without weight decay, as transformer recipes do (nanoGPT's configure_optimizers). The
order is nanoGPT's: first the parameters that no rule selects (with the optimizer's own
options), then one group per rule, each in ``model.parameters()`` order; a parameter
belongs to the first rule that selects it; a rule that selects no parameter makes no
group, and one whose parameters all went to earlier rules is an error (its options would
apply to nothing).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
from torch import nn

from jobrun.errors import RunError, a_type, did_you_mean

# How a rule selects parameters; its other keys are the group's options (lr, weight_decay...).
SELECTORS = ("ndim_below", "ndim_at_least", "names")
# Other libraries' names of an option, too far from torch's for a "did you mean"
# (Hugging Face's TrainingArguments and Keras say learning_rate).
ALIASES = {"learning_rate": "lr"}


def optimizer_class(name: str | None, target: str | None) -> str:
    """The dotted path of the optimizer: `class` names one of torch.optim."""
    if name is None:
        return target or "torch.optim.SGD"
    if target is not None:
        raise RunError("optimizer: give `class` or `target`, not both",
                       hint="class: AdamW names torch.optim.AdamW; target is a dotted path to any class")
    known = _torch_optimizers()
    if name not in known:
        same = named_optimizer(name)  # adamw: AdamW, not Adam
        raise RunError(f"optimizer: torch.optim has no optimizer {name!r}",
                       hint=(f"did you mean {same!r}?" if same else did_you_mean(str(name), known))
                       or f"one of {', '.join(sorted(known))}")
    return f"torch.optim.{name}"


def _torch_optimizers() -> list[str]:
    return [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]


def named_optimizer(value: Any) -> str | None:
    """The torch.optim optimizer `value` names, whatever its case (`adamw`: AdamW)."""
    if not isinstance(value, str):
        return None
    return next((n for n in _torch_optimizers() if n.lower() == value.lower()), None)


def group_options(cls: Any) -> dict[str, Any] | None:
    """The options a group rule may set: the keywords the optimizer's constructor takes,
    less `params` (the rule's parameters), each with its inspect.Parameter; None when it
    takes any (``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name: p for p in params if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)
            and p.name not in ("params", "self")}


def option_fault(where: str, key: str, value: Any, param: Any) -> RunError | None:
    """A value a constructor would take wrongly for its parameter ``param`` (an
    inspect.Parameter): a flag (a bool default, or typed ``bool | None``: `fused`,
    `foreach`) given as anything but true, false or (typed so) null, which Python reads as
    true (`nesterov: "false"` turned Nesterov on), and a number that is not finite (an lr
    of .inf trained to NaN). The optimizer's own keys, a torch scheduler's and a group
    rule's options (jobrun.plans.inputs, rules_fault) are checked here."""
    kind = param.annotation
    optional = kind in ("bool | None", "Optional[bool]") or set(getattr(kind, "__args__", ())) == {bool, type(None)}
    flag = isinstance(param.default, bool) or kind is bool or kind == "bool" or optional
    if flag and not isinstance(value, bool) and not (optional and value is None):
        return RunError(f"{where}: {key} must be true or false, got {value!r}",
                        hint=f"write `{key}: true` or `{key}: false`, unquoted")
    numbers = value if isinstance(value, list | tuple) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        return RunError(f"{where}: {key} must be finite, got {value!r}")
    return None


def param_groups(model: Any, groups: list[Any], cls: Any) -> list[dict[str, Any]]:
    """The parameter groups `groups` describes, for the optimizer class ``cls``."""
    if not isinstance(model, nn.Module):
        raise RunError(f"optimizer: groups need a model (an nn.Module), got {a_type(model)}")
    fault = rules_fault(groups, group_options(cls), getattr(cls, "__name__", "the optimizer"))
    if fault is not None:
        raise fault[2]
    rules = [_rule(g) for g in groups]
    params = list(model.named_parameters())  # shared parameters once, in parameters() order
    named = [n for n, _ in params]
    for i, g in enumerate(groups):  # a pattern matching nothing put its options nowhere, silently
        for pattern in g.get("names") or ():
            if not any(fnmatch.fnmatchcase(n, pattern) for n in named):
                close = [n for n in named if pattern.strip("*").lower() in n.lower()][:3]
                raise RunError(f"optimizer: groups[{i}]: names pattern {pattern!r} matches no parameter of the model",
                               hint="a pattern matches whole names, case and all (`*.bias`, `*LayerNorm.weight`)"
                                    + (f"; names like it: {', '.join(close)}" if close else
                                       f"; the model's: {', '.join(named[:4])}{', ...' if len(named) > 4 else ''}"))
    chosen: list[list[torch.Tensor]] = [[] for _ in range(len(rules) + 1)]
    owner: dict[str, int] = {}  # parameter name -> the number of the rule it went to
    for name, p in params:
        k = next((i + 1 for i, (select, _) in enumerate(rules) if select(name, p)), 0)
        chosen[k].append(p)
        owner[name] = k - 1
    for i, (select, _) in enumerate(rules):  # a rule after a broader one set its options on nothing
        taken = [n for n, p in params if select(n, p)] if not chosen[i + 1] else []
        if taken:
            earlier = sorted({owner[n] for n in taken})
            by = " and ".join(f"groups[{j}]" for j in earlier)
            raise RunError(f"optimizer: groups[{i}] gets no parameter: all {len(taken)} it selects "
                           f"({', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''}) went to {by}, "
                           f"earlier rule{'s' if len(earlier) > 1 else ''} that select{'' if len(earlier) > 1 else 's'} them too",
                           hint="a parameter goes to the first rule that selects it: put the more specific "
                                f"rule first (groups[{i}] before groups[{earlier[0]}]), or remove groups[{i}]")
    out = [{"params": chosen[0]}] if chosen[0] else []
    out += [{"params": ps, **opts} for ps, (_, opts) in zip(chosen[1:], rules) if ps]
    return out


def rules_fault(groups: Any, options: dict[str, Any] | None, name: str) -> tuple[int | None, str | None, RunError] | None:
    """What is wrong with the rules `groups`, short of the model they select from: the
    number of the rule at fault (None: `groups` itself), the key at fault (None: the rule
    as a whole) and the error. ``options``: group_options' for the optimizer class
    ``name`` (None: any key), whose values are checked as the optimizer's own keys are
    (option_fault). The run and
    the check before it (jobrun.plans.inputs) both ask here."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return None, None, RunError("optimizer: `groups` is a list of rules",
                                    hint="groups: [{ndim_below: 2, weight_decay: 0.0}]")
    for i, group in enumerate(groups):
        where = f"optimizer: groups[{i}]"
        if not any(k in SELECTORS for k in group):
            return i, None, RunError(f"{where} selects no parameters",
                                     hint=f"give one of {', '.join(SELECTORS)}, e.g. ndim_below: 2")
        for key in group:
            if key not in SELECTORS and options is not None and key not in options:
                known = sorted(options)
                alias = ALIASES.get(key)
                return i, key, RunError(
                    f"{where}: {key!r} is neither a selector nor an option of {name}",
                    hint=(f"did you mean {alias!r}?" if alias in options else did_you_mean(key, [*SELECTORS, *known]))
                    or f"selectors: {', '.join(SELECTORS)}; options of {name}: {', '.join(known)}")
            if key not in SELECTORS and options is not None and (fault := option_fault(where, key, group[key], options[key])):
                return i, key, fault  # `nesterov: "false"` in a rule turned Nesterov on for its group
        for key in ("ndim_below", "ndim_at_least"):
            value = group.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                return i, key, RunError(f"{where}: {key} is a number of dimensions, got {value!r}")
        names = group.get("names")
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            return i, "names", RunError(f"{where}: names is a list of patterns, got {names!r}",
                                        hint='names: ["*.bias", "*norm*"] (shell patterns on parameter names)')
    return None


def _rule(group: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A rule rules_fault found nothing wrong with: its selection and its options."""
    opts = {k: v for k, v in group.items() if k not in SELECTORS}
    below, least, names = (group.get(k) for k in SELECTORS)

    def select(name: str, p: torch.Tensor) -> bool:
        return ((below is None or p.dim() < below) and (least is None or p.dim() >= least)
                and (names is None or any(fnmatch.fnmatchcase(name, n) for n in names)))

    return select, opts


def describe(opt: torch.optim.Optimizer, model: Any) -> list[str]:
    """One line per parameter group: its size and options (for messages and tests)."""
    names = {id(p): n for n, p in model.named_parameters()} if isinstance(model, nn.Module) else {}
    lines = []
    for i, g in enumerate(opt.param_groups):
        shown = [names.get(id(p), "?") for p in g["params"]]
        lines.append(f"group {i}: {len(shown)} tensors ({', '.join(shown[:4])}"
                     f"{', ...' if len(shown) > 4 else ''}), weight_decay={g.get('weight_decay')}")
    return lines
