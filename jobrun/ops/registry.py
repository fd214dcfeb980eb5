"""The op registry: core signatures, the torch library's, and users' entry points.

Everything here is data; implementations are imported only when a job runs
(:func:`resolve_impl`). Users add ops through the `jobrun.ops` entry-point group: an
entry point names an OpSpec, a sequence of them, or a function returning either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

from jobrun.ops.spec import OpSpec, arg

_C = "jobrun.ops.core:"
_NUM = ("or", "number", "bool")
# Ops that change none of their inputs and whose output holds on to none of them.
_PURE: dict = {"mutates": (), "keeps": ()}
_DTYPE = ("choice", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")


def _binary(name: str, doc: str, impl: str, variadic: bool = False) -> OpSpec:
    return OpSpec(
        name,
        doc,
        _C + impl,
        inputs=("a", "b"),
        outputs=("c",),
        max_inputs=None if variadic else "fixed",
        example=f"- {name}: {{in: [a, b], out: c}}",
        **_PURE,
    )


CORE_SPECS: tuple[OpSpec, ...] = (
    OpSpec(
        "const", "A constant: a scalar stays a Python scalar, a list becomes a tensor.",
        _C + "const", outputs=("x",), args=(arg("value", "any", doc="the value"),),
        example="- const: {out: lr, value: 0.1}", **_PURE,
    ),
    OpSpec(
        "fill", "A tensor of the given shape filled with one value.", _C + "fill",
        outputs=("x",),
        args=(arg("shape", "shape"), arg("value", _NUM, 0.0), arg("dtype", _DTYPE, "float32")),
        example="- fill: {out: w, shape: [8], value: 1.0}", **_PURE,
    ),
    OpSpec(
        "randn", "Normal random tensor from the node's seeded generator.", _C + "randn",
        outputs=("x",),
        args=(arg("shape", "shape"), arg("mean", "number", 0.0), arg("std", "number", 1.0)),
        example="- randn: {out: noise, shape: [4, 4], std: 0.01}", **_PURE,
    ),
    OpSpec("copy", "Copy a blob (tensors are cloned).", _C + "copy", inputs=("a",), outputs=("b",),
           example="- copy: {in: a, out: b}", **_PURE),
    _binary("add", "Elementwise sum of any number of inputs.", "add", variadic=True),
    _binary("sub", "Elementwise a - b.", "sub"),
    _binary("mul", "Elementwise product of any number of inputs.", "mul", variadic=True),
    _binary("div", "Elementwise a / b.", "div"),
    _binary("ge", "a >= b: a bool for scalars, a bool tensor for tensors.", "ge"),
    _binary("gt", "a > b.", "gt"),
    _binary("le", "a <= b.", "le"),
    _binary("lt", "a < b.", "lt"),
    _binary("eq", "a == b.", "eq"),
    _binary("ne", "a != b.", "ne"),
    _binary("and", "Logical and of truthy values (any number of inputs).", "and_", variadic=True),
    _binary("or", "Logical or of truthy values (any number of inputs).", "or_", variadic=True),
    OpSpec("not", "Logical not of a truthy value.", _C + "not_", inputs=("a",), outputs=("b",),
           example="- not: {in: done, out: going}", **_PURE),
    OpSpec(
        "reader",
        "Batches over the first dimension of its inputs (one mapping of them: dict batches), or "
        "over one torch Dataset (through a DataLoader); its position is checkpointed.",
        "jobrun.ops.reader:reader_op", inputs=("fields",), outputs=("r",), max_inputs=None,
        args=(
            arg("batch_size", "int>=1", 1, "global batch size; 1 = one record, unbatched"),
            arg("shuffle", "bool", False, "a new seeded permutation every pass"),
            arg("passes", "int>=0", 1, "passes over the data; 0 = forever"),
            arg("drop_last", "bool", False, "drop a short final batch"),
            arg("window", ("or", "int>=1", "null"), None,
                "one 1-D token stream in: records are windows, x = tokens[i:i+T], y = tokens[i+1:i+T+1]"),
            arg("sample", ("choice", "order", "random"), "order",
                "windows: order (non-overlapping, in passes) or random (starts from the node's generator, endless)"),
            arg("keys", ("or", "list", "null"), None,
                "each batch one dict {key: field}, e.g. [input_ids, labels] (train.step's "
                "dict batch, model(**batch)); not for a Dataset, whose items give their keys"),
            arg("num_workers", "int>=0", 0, "Dataset: worker processes fetching batches"),
            arg("pin_memory", "bool", False, "Dataset: pinned host memory (for a CUDA device)"),
            arg("prefetch_factor", ("or", "int>=1", "null"), None,
                "Dataset: batches each worker fetches ahead (null: 2)"),
            arg("persistent_workers", "bool", False, "Dataset: keep the workers between passes"),
            arg("collate_fn", ("or", "str", "null"), None,
                'Dataset: "pkg.mod:fn" turning a list of samples into a batch'),
            arg("timeout", "number>=0", 0, "Dataset: seconds to wait for a worker's batch; 0 = no limit"),
        ),
        example="- reader: {in: [x, y], out: data, batch_size: 32, shuffle: true}",
        **_PURE,  # `read` changes the reader's position, never its data
    ),
    OpSpec(
        "read", "Next record/batch and `done` (true once at the end of each pass, fields null; without `done` in out, the next pass goes on).",
        "jobrun.ops.reader:read_op", inputs=("r",), outputs=("fields", "done"), min_outputs=1,
        max_outputs=None, example="- read: {in: data, out: [xb, yb, done]}",
        mutates=("r",), keeps=(), bind="jobrun.ops.bound:bind_read",
    ),
    OpSpec(
        "log", "Record values: the epoch's summary line (a line of their own outside epochs), "
        "metrics.jsonl, TensorBoard, at the global step. every: K logs at steps 0, K, 2K, ... only.",
        _C + "log", inputs=("values",), min_inputs=0, max_inputs=None,
        args=(arg("msg", ("or", "str", "null"), None),),
        example="- log: {in: [loss], every: 50}", **_PURE,
    ),
    OpSpec(
        "save", "Write blobs to a file (.json, .safetensors or .pt), relative to the run directory.",
        _C + "save", inputs=("blobs",), min_inputs=1, max_inputs=None, args=(arg("path", "str"),),
        example="- save: {in: [model], path: model.safetensors}", **_PURE,
    ),
    OpSpec(
        "load", "Read blobs from a file written by `save`, relative to the plan's directory.",
        _C + "load", outputs=("blobs",), min_outputs=1, max_outputs=None, args=(arg("path", "str"),),
        example="- load: {out: [w], path: weights.safetensors}", **_PURE,
    ),
    OpSpec(
        "checkpoint.load", "Load the named blobs' state saved in this run's checkpoint of `epoch` "
        "into them, in place (models, optimizers: load_state_dict; tensors: copied); in download "
        "or exit, e.g. to test the best epoch's weights.",
        _C + "checkpoint_load", inputs=("blobs",), min_inputs=1, max_inputs=None,
        args=(arg("epoch", ("or", "int>=0", ("choice", "best", "last")), "best",
                  "best (by checkpoint.best), last, or an epoch's number"),),
        example="- checkpoint.load: {in: model, epoch: best}", mutates=("blobs",), keeps=(),
    ),
    OpSpec(
        "call", "Call user code `pkg.mod:func` with the inputs as positional arguments; parameters "
        "without a default named rank, world_size, device, generator, step or epoch get the run's values.",
        _C + "call", inputs=("args",), outputs=("results",), min_inputs=0, max_inputs=None,
        min_outputs=0, max_outputs=None,
        args=(
            arg("fn", "str", doc='"package.module:function"'),
            arg("mutates", ("or", "list", "null"), None,
                "the inputs it changes in place, for checkpoints (null: the inputs that are not "
                "data: models, optimizers, readers, results of calls not declared pure)"),
            arg("pure", "bool", False,
                "it changes none of its inputs and its results hold none of them: its results "
                "are data (not checkpointed for what later calls do with them)"),
        ),
        extra_args=True, example='- call: {fn: "mypkg.metrics:f1", in: [pred, y], out: f1, mutates: []}',
    ),
)


@lru_cache(maxsize=1)
def registry() -> dict[str, OpSpec]:
    """All known ops by name: core, training, then users' entry points."""
    from jobrun.ops.train_specs import TRAIN_SPECS

    ops: dict[str, OpSpec] = {}
    for spec in (*CORE_SPECS, *TRAIN_SPECS):
        ops[spec.name] = spec
    for spec in _entry_point_specs():
        ops.setdefault(spec.name, spec)
    return ops


def _entry_point_specs() -> Iterable[OpSpec]:
    from importlib.metadata import entry_points

    for ep in entry_points(group="jobrun.ops"):
        try:
            obj = ep.load()
        except Exception as e:  # a broken plug-in must not break `jobrun print`
            import warnings

            warnings.warn(f"jobrun: cannot load op plug-in {ep.name!r} ({ep.value}): {e}", stacklevel=2)
            continue
        if callable(obj) and not isinstance(obj, OpSpec):
            obj = obj()
        for spec in [obj] if isinstance(obj, OpSpec) else list(obj):
            if isinstance(spec, OpSpec):
                yield spec if spec.category != "core" else _as_user(spec)


def _as_user(spec: OpSpec) -> OpSpec:
    from dataclasses import replace

    return replace(spec, category="user")


def resolve_impl(spec: OpSpec) -> Callable[..., Any]:
    """Import an op's implementation (torch is imported here, at run time only)."""
    from jobrun.ops.imports import resolve

    return resolve(spec.impl, spec.name, "implementation")


def bound_impl(spec: OpSpec, ctx: Any, kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """The op bound to one call site's arguments (its spec's `bind`, see jobrun/ops/bound.py),
    a function of the inputs only; None when the op does not bind there."""
    from jobrun.ops.imports import resolve

    return None if spec.bind is None else resolve(spec.bind, spec.name, "binding")(ctx, **kwargs)
