"""Signatures of the training ops: data only, no torch.

Implementations: :mod:`jobrun.ops.data`, :mod:`jobrun.ops.models`, :mod:`jobrun.ops.train`
and :mod:`jobrun.ops.dist`.

`reader`/`read` are core ops and are declared in :mod:`jobrun.ops.registry`.
"""

from __future__ import annotations

from jobrun.ops.spec import OpSpec, arg

_LOSS_DOC = (
    "cross_entropy, mse, a dotted path to a callable(pred, y) giving the batch mean, or model: "
    "the model computes it, model(x, y) (labels=y for Hugging Face) or model(**batch)"
)
_STR_OR_NULL = ("or", "str", "null")
# The value types of a raw `.bin` file `data.load` reads (numpy's names).
RAW_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "float16", "float32", "float64")
_LIST_OR_NULL = ("or", "list", "null")
# torch.optim's optimizers (torch 2.13), for `class:` (any other class: `target`).
OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS",
              "Muon", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")


def _training(name: str, doc: str, impl: str, example: str, **fields) -> OpSpec:
    """A training op; `impl` is "module:function" within jobrun.ops. Unless it says
    otherwise, it changes none of its inputs and its output holds on to none of them."""
    fields = {"mutates": (), "keeps": (), **fields}
    return OpSpec(name, doc, f"jobrun.ops.{impl}", category="training", example=example, **fields)


TRAIN_SPECS: tuple[OpSpec, ...] = (
    _training(
        "data.synthetic",
        "A seeded toy data set: class clusters or a noisy linear teacher (float32 x).",
        "data:data_synthetic",
        "- data.synthetic: {out: [x, y], task: classification, n: 512, features: 8, classes: 3}",
        outputs=("x", "y"),
        args=(
            arg("task", ("choice", "classification", "regression"), doc="what y is"),
            arg("n", "int>=1", doc="number of records"),
            arg("features", "int>=1", doc="columns of x"),
            arg("classes", ("or", "int>=2", "null"), None, "number of classes (classification)"),
            arg("noise", "number>=0", 0.1, "standard deviation of the noise added"),
            arg("seed", "int", 0, "the problem (centres, teacher) and, by default, the samples"),
            arg("sample_seed", ("or", "int", "null"), None,
                "draw the samples from this seed instead: a validation set of the same problem"),
        ),
    ),
    _training(
        "data.load",
        "Arrays from .npz, .npy, .bin (raw, memory-mapped), .csv, .safetensors or .pt, as CPU "
        "tensors, one per output.",
        "data:data_load",
        "- data.load: {out: [x, y], path: data/train.npz, keys: [x, y]}",
        outputs=("arrays",),
        min_outputs=1,
        max_outputs=None,
        args=(
            arg("path", "str", doc="file to read, relative to the plan's directory"),
            arg(
                "keys", _LIST_OR_NULL, None, "arrays to load, in output order (npz/safetensors/pt)"
            ),
            arg("columns", _LIST_OR_NULL, None, "csv: one output per item; a list item gives 2-D"),
            arg("header", ("or", "bool", "null"), None, "csv: first row is names (null: detect)"),
            arg("delimiter", "str", ",", "csv field separator"),
            arg(
                "float_dtype",
                ("or", ("choice", "float32", "float64", "float16", "bfloat16"), "null"),
                "float32",
                "floating arrays are cast to this; null keeps the stored type",
            ),
            arg("dtype", ("or", ("choice", *RAW_DTYPES), "null"), None,
                "a raw .bin file's values: uint8, uint16 (nanoGPT's tokens), int32, float32, ..."),
            arg("mmap", ("or", "bool", "null"), None,
                "memory-map .bin/.npy (copy-on-write); null: .bin always, .npy from 64 MiB"),
        ),
    ),
    _training(
        "build",
        "Instantiate any `target` with `args` and keyword arguments (nested targets too).",
        "models:build",
        "- build: {out: model, target: torch.nn.Linear, args: [8, 2], bias: true}",
        inputs=("inputs",),
        outputs=("obj",),
        min_inputs=0,
        max_inputs=None,
        extra_args=True,
        keeps=None,  # what it builds may hold on to its inputs (a wrapper, a data set)
        args=(
            arg("target", "str", doc='"pkg.mod:Class" or dotted "pkg.mod.Class"'),
            arg("args", _LIST_OR_NULL, None, "positional arguments after the inputs"),
            arg("fork_rng", "bool", False,
                "draw from a seed of the node's generator, leaving torch's global stream alone "
                "(false: from torch's global generator, as a hand loop's constructor)"),
            arg("compile", "bool", False, "a module: torch.compile its forward (in place, same state keys)"),
        ),
    ),
    _training(
        "model.mlp",
        "A multi-layer perceptron: Linear layers with an activation (and dropout) between.",
        "models:model_mlp",
        "- model.mlp: {out: model, sizes: [8, 32, 3], activation: relu}",
        outputs=("model",),
        args=(
            arg("sizes", "sizes", doc="[in, hidden..., out]"),
            arg("activation", ("choice", "relu", "gelu", "tanh"), "relu", "between layers"),
            arg("dropout", "number", 0.0, "dropout probability after each activation"),
            arg("compile", "bool", False, "torch.compile its forward (in place, same state keys)"),
        ),
    ),
    _training(
        "optimizer",
        "An optimizer over the model's parameters; other keys go to its constructor.",
        "models:optimizer",
        "- optimizer: {in: model, out: opt, class: SGD, lr: 0.1, momentum: 0.9}",
        inputs=("model",),
        outputs=("opt",),
        extra_args=True,
        keeps=("model",),  # stepping it changes the parameters
        args=(
            arg("class", ("or", ("choice", *OPTIMIZERS), "null"), None,
                "an optimizer of torch.optim by name, e.g. AdamW (or `target`)"),
            arg("target", _STR_OR_NULL, None,
                "dotted path of the optimizer class (null: torch.optim.SGD)"),
            arg("groups", _LIST_OR_NULL, None,
                "parameter groups by rule: [{ndim_below: 2, weight_decay: 0.0}] (selectors "
                "ndim_below, ndim_at_least, names: shell patterns; other keys: the group's options)"),
        ),
    ),
    _training(
        "scheduler",
        "Without a target: linear warmup, then a cosine, linear or constant decay, computed in "
        "closed form from the global step before every step of the optimizer. With a target: "
        "that torch scheduler (other keys go to its constructor; nested {target: ...} mappings "
        "are built on the same optimizer), advanced by scheduler.step.",
        "models:scheduler",
        "- scheduler: {in: opt, out: sched, warmup: 100, decay: cosine, steps: 5000, min_ratio: 0.1}",
        inputs=("opt",),
        outputs=("sched",),
        extra_args=True,
        keeps=("opt",),  # stepping it sets the optimizer's learning rate
        args=(
            arg("target", _STR_OR_NULL, None,
                "dotted path, e.g. torch.optim.lr_scheduler.StepLR; null: by the global step"),
            arg("warmup", "int>=0", 0, "no target: steps of linear warmup, lr * (step + 1) / (warmup + 1)"),
            arg("decay", ("choice", "cosine", "linear", "constant"), "cosine",
                "no target: the shape after warmup"),
            arg("steps", ("or", "int", "null"), None,
                "no target: the step where the decay ends (min_lr from there on)"),
            arg("min_lr", ("or", "number>=0", "null"), None, "no target: the final rate (every group)"),
            arg("min_ratio", "number>=0", 0.0, "no target: the final rate as a fraction of each group's lr"),
        ),
    ),
    _training(
        "scheduler.step",
        "Advance a scheduler; a second input is the metric for ReduceLROnPlateau.",
        "models:scheduler_step",
        "- scheduler.step: {in: sched}",
        inputs=("sched", "metric"),
        min_inputs=1,
        mutates=("sched",),
    ),
    _training(  # not `optimizer.lr`: `init.setup.optimizer.lr=0.01` must keep naming optimizer's lr
        "optimizer.rate",
        "The learning rate (lr) of one parameter group now, a float: what a scheduler set last.",
        "models:optimizer_rate",
        "- optimizer.rate: {in: opt, out: lr}",
        inputs=("opt",),
        outputs=("lr",),
        args=(arg("group", "int>=0", 0, "the parameter group (0: the first)"),),
    ),
    _training(
        "train.step",
        "One optimizer step on a batch (x, y), or on one dict batch with loss: model (in: [model, "
        "opt, batch]: model(**batch)); loss is the global-batch mean (its float32 value), equal on all ranks.",
        "train:train_step",
        "- train.step: {in: [model, opt, xb, yb], out: loss, loss: cross_entropy}",
        inputs=("model", "opt", "x", "y"),
        min_inputs=3,  # [model, opt, batch]: a dict batch, its keys the model's arguments
        outputs=("loss",),
        mutates=("model", "opt"),
        bind="jobrun.ops.bound:bind_step",
        args=(
            arg("loss", "loss", "cross_entropy", _LOSS_DOC),
            arg("clip_grad_norm", ("or", "number>0", "null"), None, "clip the gradient norm to this"),
            arg("accumulate", "int>=1", 1, "micro-batches per step (same step, less memory)"),
            arg(
                "amp",
                ("or", ("choice", "bf16", "fp16"), "null"),
                None,
                "mixed precision: autocast on the run's device (CPU or CUDA)",
            ),
        ),
    ),
    _training(
        "evaluate",
        "Mean loss and accuracy over one full pass of a reader (or its next `batches`), no gradients, all ranks.",
        "train:evaluate",
        "- evaluate: {in: [model, test], out: [test_loss, test_acc]}",
        inputs=("model", "reader"),
        outputs=("loss", "accuracy"),
        args=(
            arg("loss", "loss", "cross_entropy", _LOSS_DOC + "; accuracy is null for mse"),
            arg("amp", ("or", ("choice", "bf16", "fp16"), "null"), None,
                "mixed precision: autocast the forward and the loss, as train.step's amp"),
            arg("batches", ("or", "int>=1", "null"), None,
                "the reader's next N batches (moving its position) instead of one full pass; "
                "loss: the mean of the N batch losses, as a hand loop's estimate"),
        ),
    ),
    _training(
        "export",
        "Write an inference-only program of the model with torch.export; outputs its path.",
        "models:export",
        "- export: {in: [model, xb], out: exported, path: model.pt2}",
        inputs=("model", "example_input"),
        outputs=("path",),
        args=(
            arg("path", "str", "model.pt2", "file to write, relative to the run directory"),
            arg("dynamic_batch", "bool", True, "let the first dimension vary"),
        ),
    ),
    _training(
        "dist.allreduce",
        "Reduce a tensor or number over data-parallel ranks (identity with one rank).",
        "dist:dist_allreduce",
        "- dist.allreduce: {in: correct, out: total, op: sum}",
        inputs=("x",),
        outputs=("y",),
        args=(arg("op", ("choice", "sum", "mean", "max", "min"), "sum", "the reduction"),),
    ),
    _training(
        "dist.broadcast",
        "Rank `src`'s tensor or number, on every rank.",
        "dist:dist_broadcast",
        "- dist.broadcast: {in: x, out: y, src: 0}",
        inputs=("x",),
        outputs=("y",),
        args=(arg("src", "int", 0, "the rank whose value is sent"),),
    ),
    _training(
        "model.gather",
        "A CPU copy of the model's full state dict on rank 0 (null on other ranks).",
        "dist:model_gather",
        "- model.gather: {in: model, out: params}",
        inputs=("model",),
        outputs=("state",),
    ),
)
