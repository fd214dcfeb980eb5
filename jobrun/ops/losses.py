"""Losses of `train.step` and `evaluate`: by name, by dotted path, or the model's own.

A loss is "cross_entropy", "mse", the path of a callable ``(pred, y) -> batch mean``, or
"model": the model computes its loss itself (nanoGPT, Hugging Face), called as

    model(**x)                 x is a mapping (a dict batch): its keys are forward's arguments
    model(x, labels=y)         forward has a parameter named `labels` (Hugging Face)
    model(x, y)                otherwise (nanoGPT's forward(idx, targets))

and its output gives the loss: a scalar tensor; a tuple or list holding one 0-d tensor
(nanoGPT's ``(logits, loss)``, Hugging Face's ``(loss, logits, ...)``); a mapping or an
object with ``loss`` (Hugging Face's ModelOutput). Logits, when the output has them, give
`evaluate`'s accuracy. :func:`forward` is the one place both ops compute a batch's
loss with it (train.step through :func:`model_loss`, tested against the loss's name, so
that the common case costs no extra call per step).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from jobrun.errors import RunError, did_you_mean
from jobrun.ops.imports import resolve

_LONG = torch.long
_Tensor = torch.Tensor

MODEL = "model"  # `loss: model`


def _cross_entropy(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.dtype is _LONG and pred.__class__ is _Tensor and pred.ndim == 2:
        # The common case first, in attribute reads: each method call here costs ~1 us
        # between the step's kernels (cold caches), a tiny model's step ~400 us.
        return F.cross_entropy(pred, y)
    _predictions(pred, "cross_entropy")
    if y.is_floating_point() and y.dim() == pred.dim() - 1:
        y = y.long()  # class indices stored as floats (e.g. read from a CSV file)
    if pred.dim() > 2 and y.dim() == pred.dim() - 1:
        # sequence outputs [B, T, V] against labels [B, T]: one class per position
        return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), y.reshape(-1))
    return F.cross_entropy(pred, y)


def _mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _predictions(pred, "mse")
    if not y.is_floating_point():
        y = y.to(pred.dtype)
    if y.shape != pred.shape and y.numel() == pred.numel():
        y = y.reshape(pred.shape)  # [n] targets against [n, 1] predictions
    return F.mse_loss(pred, y)


def _predictions(pred: Any, loss: str) -> None:
    """Refuse a model output that is no tensor of predictions (a nanoGPT model's (logits,
    loss), a Hugging Face ModelOutput) for a loss computed from predictions."""
    if isinstance(pred, _Tensor):
        return
    what = f"a {type(pred).__name__}"
    if isinstance(pred, tuple | list):
        what += f" of {len(pred)}"
    raise RunError(
        f"the model returned {what}, not a tensor of predictions, which loss {loss!r} needs",
        hint="a model that computes its loss itself (nanoGPT's (logits, loss), Hugging Face's "
             "output with .loss) takes `loss: model`; else make forward return the predictions",
    )


def model_loss(model: Any, x: Any, y: Any) -> torch.Tensor:
    """`loss: model`: the loss the model computes itself (see the module's doc)."""
    return forward(model_loss, model, x, y)[1]


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "mse": _mse,
    MODEL: model_loss,  # called as (model, x, y), not (pred, y)
}


@functools.lru_cache(maxsize=64)
def loss_fn(name: str, op: str) -> Callable[..., torch.Tensor]:
    """A loss by name; a path names a callable(pred, y) giving the batch mean.

    Cached: a dotted path is resolved once, not at every step.
    """
    if name in LOSSES:
        return LOSSES[name]
    if "." in name or ":" in name:
        return resolve(name, op, "loss")
    raise RunError(
        f"{op}: unknown loss {name!r}",
        hint=did_you_mean(name, LOSSES) or "cross_entropy, mse, model, or a dotted path",
    )


def forward(fn: Callable[..., torch.Tensor], model: Any, x: Any, y: Any) -> tuple[Any, torch.Tensor]:
    """(predictions or logits, loss) of one batch. With `loss: model` the predictions are
    the output's logits, or None when it has none."""
    if fn is not model_loss:
        pred = model(x)
        return pred, fn(pred, y)
    if isinstance(x, Mapping):
        try:
            out = model(**x)
        except TypeError as e:  # only diagnosed on failure: no cost per step
            problem = _keys_problem(model, x)
            if problem is None:
                raise
            raise RunError(f"loss: model: {problem}", hint=_keys_hint(model, x)) from e
    elif _takes_labels(model):
        out = model(x, labels=y)
    else:
        out = model(x, y)
    return _loss_and_logits(out, model, x)


def _inner(model: Any) -> Any:
    """The model wrappers hold (DDP's `module`, torch.compile's `_orig_mod`)."""
    inner = model
    for attr in ("_orig_mod", "module"):
        inner = getattr(inner, attr, inner)
    return inner


def _takes_labels(model: Any) -> bool:
    """Whether the model's forward names its targets `labels` (Hugging Face's models),
    read once per class. Wrappers (DDP's `module`, torch.compile's `_orig_mod`) are
    looked through."""
    return _labels_param(type(_inner(model)))


def _forward_params(model: Any) -> tuple[list[str], list[str], bool] | None:
    """(the forward's parameter names, those it requires, whether it takes **kwargs), or
    None when its signature cannot be read."""
    cls = type(_inner(model))
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError, AttributeError):
        return None
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = [p.name for p in params
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named, required, any(p.kind is p.VAR_KEYWORD for p in params)


def _keys_problem(model: Any, batch: Mapping) -> str | None:
    """What is wrong between a dict batch's keys and the model's forward, or None."""
    found = _forward_params(model)
    if found is None:
        return None
    named, required, any_key = found
    name = f"{type(_inner(model)).__name__}.forward"
    unknown = [k for k in batch if k not in named]
    if unknown and not any_key:
        return f"the batch's key {unknown[0]!r} is not a parameter of {name}"
    missing = [k for k in required if k not in batch]
    if missing:
        return f"{name} needs {missing[0]!r}, which the batch lacks"
    return None


def _keys_hint(model: Any, batch: Mapping) -> str:
    """The batch's keys against the forward's parameters (a likely misspelled key first)."""
    found = _forward_params(model)
    if found is None:
        return f"the batch's keys are: {', '.join(map(str, batch))}"
    named = found[0]
    close = [did_you_mean(str(k), named) for k in batch if k not in named]
    guess = next((c for c in close if c), None)
    text = (f"the batch's keys: {', '.join(map(str, batch))}; the forward's parameters: "
            f"{', '.join(named)}; name the dataset's keys after them")
    return f"{guess}; {text}" if guess else text


@functools.lru_cache(maxsize=256)
def _labels_param(cls: type) -> bool:
    try:
        return "labels" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def _loss_and_logits(out: Any, model: Any, x: Any = None) -> tuple[Any, torch.Tensor]:
    logits = None
    if out.__class__ is _Tensor or isinstance(out, _Tensor):
        loss = out
    elif isinstance(out, tuple | list):
        scalars = [v for v in out if isinstance(v, _Tensor) and v.dim() == 0]
        if not scalars and any(v is None for v in out):
            scalars = [None]  # nanoGPT's (logits, None): it got no targets
        if len(scalars) != 1:
            raise RunError(
                f"loss: model: the model returned a {type(out).__name__} of {len(out)} items "
                f"with {len(scalars)} scalar tensors; which one is the loss?",
                hint="return (logits, loss) as nanoGPT does, a scalar loss, or an object with `loss`",
            )
        loss = scalars[0]
        logits = next((v for v in out if isinstance(v, _Tensor) and v.dim() > 0), None)
    elif isinstance(out, Mapping) and "loss" in out:
        loss, logits = out["loss"], out.get("logits")
    elif hasattr(out, "loss"):
        loss, logits = out.loss, getattr(out, "logits", None)
    else:
        raise RunError(
            f"loss: model: the model returned a {type(out).__name__}, with no loss in it",
            hint="its forward(x, y) must return the loss: a scalar tensor, (logits, loss), "
            "or an object with `loss` (Hugging Face's ModelOutput)",
        )
    if not isinstance(loss, _Tensor) or loss.numel() != 1:
        what = "None" if loss is None else (
            f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, _Tensor) else type(loss).__name__)
        hint = ("the model computes its loss only when given the targets: check that the "
                "reader gives (x, y), or that a dict batch holds `labels`")
        if isinstance(x, Mapping):  # a misspelled key a forward's **kwargs swallowed
            hint = f"{hint}; {_keys_hint(model, x)}"
        raise RunError(f"loss: model: the model's loss is {what}, not a scalar tensor", hint=hint)
    return logits, loss.reshape(()) if loss.dim() else loss


def accuracy_logits(model: Any, logits: torch.Tensor, y: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits, labels) to compare for accuracy with `loss: model`, or None.

    Causal language models of Hugging Face (``...ForCausalLM``, ``...LMHeadModel``) shift
    their labels inside: position t predicts label t + 1, and accuracy compares the same.
    """
    if not isinstance(y, _Tensor) or y.is_floating_point() or logits.dim() != y.dim() + 1:
        return None
    if tuple(logits.shape[:-1]) != tuple(y.shape):
        return None
    inner = _inner(model)
    name = type(inner).__name__
    if _labels_param(type(inner)) and name.endswith(("ForCausalLM", "LMHeadModel")) and y.dim() >= 2:
        return logits[..., :-1, :], y[..., 1:]
    return logits, y
