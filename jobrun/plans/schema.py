"""A JSON Schema (draft 2020-12) of the plan file, for editors and external checks.

    schema = plan_schema()          # `jobrun schema` prints it

It is derived, not written out: the keys come from the compiler's key lists
(:mod:`jobrun.plans.keys`), the name patterns from its regular expressions and
every op step from the op registry, with its arguments typed from their ArgSpec. So a new
op (a user's plug-in included) or a new key shows up here without editing this file.

Values are checked as written in the file, before `${var}` substitution: wherever a number
or boolean is expected, a string that is exactly `${name}` is accepted too, and a name may
be built from vars (`enc_${i}`). Whether ops exist and their arguments fit is checked
here too, as `jobrun analyze` does; what only the analyzer can see (data flow, races,
stop conditions) is not.
"""

from __future__ import annotations

from typing import Any

from jobrun import __version__
from jobrun.plans import keys as plan_keys
from jobrun.plans.resolve import BUILTINS, VAR_NAME
from jobrun.plans.schema_ops import BLOB, EVERY, STEP_ID, VAR, anchored, op_call, op_def, op_schema

SCHEMA_ID = "urn:jobrun:plan-schema"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
VAR_EXACT = r"^\$\{[^}]+\}$"  # takes the var's type after substitution
VAR_INSIDE = r"\$\{[^}]+\}"  # a string built from vars: only its result can be checked

BLOCK = {"$ref": "#/$defs/block"}
NAME = {"$ref": "#/$defs/name"}


def plan_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file, with descriptions for every key and op."""
    from jobrun.ops.registry import registry

    ops = registry()
    defs: dict[str, Any] = {
        **_name_defs(),
        "task": _task(),
        "checkpoint": _checkpoint(),
        "early_stop": _watch(
            "Stop once `patience` epochs in a row bring no improvement of `monitor` larger "
            "than `min_delta` (Lightning's EarlyStopping).",
            plan_keys.EARLY_STOP_KEYS,
            {
                "patience": _int("Epochs in a row without improvement before the job stops (default 3).", 0),
                "min_delta": {
                    "description": "An improvement must be larger than this (default 0).",
                    "anyOf": [{"type": "number", "minimum": 0}, VAR],
                },
            },
        ),
        "best": _watch(
            "Keep the `keep` best epochs by `monitor` beside the newest ones; "
            "`jobrun export --best` and `jobrun resume --epoch best` use the best.",
            plan_keys.BEST_KEYS,
            {"keep": _int("How many of the best epochs to keep (default 1).", 1)},
        ),
        "block": {
            "description": "A list of steps, run in order.",
            "type": ["array", "null"],
            "items": {"$ref": "#/$defs/step"},
        },
        "step": _step(),
        **_control_defs(),
        "op_call": op_call(ops),
        "input": {
            "description": "A blob name, or a number or boolean literal.",
            "anyOf": [BLOB, {"type": ["number", "boolean"]}, VAR],
        },
        **{op_def(name): op_schema(spec) for name, spec in ops.items()},
    }
    return {
        "$schema": DRAFT,
        "$id": SCHEMA_ID,
        "title": "jobrun plan",
        "description": (
            f"A jobrun {__version__} plan: a training job as four task groups (init, epoch, "
            "download, exit) of steps that call ops on named blobs. Check it with "
            "`jobrun analyze`, read it with `jobrun print`."
        ),
        "type": "object",
        "properties": _keyed(plan_keys.TOP_KEYS, _top_properties()),
        "required": ["job", "epoch"],
        "additionalProperties": False,
        "$defs": defs,
    }


def _keyed(keys: tuple[str, ...], known: dict[str, dict[str, Any]]) -> dict[str, Any]:
    # The compiler's key list is the truth: a key it gains before this module learns about
    # it is still allowed (with no checks), never refused.
    return {key: known.get(key, {"description": f"`{key}` (not described yet)"}) for key in keys}


def _int(description: str, minimum: int | None = None, maximum: int | None = None) -> dict[str, Any]:
    number: dict[str, Any] = {"type": "integer"}
    if minimum is not None:
        number["minimum"] = minimum
    if maximum is not None:
        number["maximum"] = maximum
    return {"description": description, "anyOf": [number, VAR]}


def _names(description: str) -> dict[str, Any]:
    return {"description": description, "anyOf": [BLOB, {"type": "array", "items": BLOB}]}


# -- names and vars ----------------------------------------------------------------------


def _name_defs() -> dict[str, Any]:
    no_dots = {"not": {"pattern": r"\.\."}}
    return {
        "var": {
            "description": "A `${name}` reference to a var, replaced by its value (and type).",
            "type": "string",
            "pattern": VAR_EXACT,
        },
        "blob": {
            "description": (
                "A blob name: letters, digits and _ (not first), scopes joined by '/' (enc/w)."
            ),
            "type": "string",
            "anyOf": [
                {"pattern": anchored(plan_keys.BLOB_NAME)},
                {"pattern": VAR_INSIDE},
            ],
        },
        "name": {
            "description": (
                "A task, node or branch name: 1-64 letters, digits, '_', '.', '-', starting "
                "with a letter or digit, no '..'."
            ),
            "type": "string",
            "anyOf": [
                {"pattern": anchored(plan_keys.NODE_NAME), **no_dots},
                {"pattern": VAR_INSIDE},
            ],
        },
        "duration": {
            "description": "A duration with its unit: 500ms, 2s, 1.5s.",
            "type": "string",
            "anyOf": [{"pattern": anchored(plan_keys.DURATION)}, {"pattern": VAR_INSIDE}],
        },
    }


# -- plan, task, checkpoint ------------------------------------------------------------


def _group(name: str, description: str, required: bool = False) -> dict[str, Any]:
    group: dict[str, Any] = {
        "description": description,
        "type": "array" if required else ["array", "null"],
        "items": {"$ref": "#/$defs/task"},
    }
    if required:
        group["minItems"] = 1
    return group


def _top_properties() -> dict[str, dict[str, Any]]:
    return {
        "job": {
            "description": "The job's name (also the default run directory, runs/<job>).",
            "type": "string",
            "pattern": anchored(plan_keys.NODE_NAME),
            "not": {"pattern": r"\.\."},  # vars are not substituted in the job name
        },
        "seed": _int("Seeds torch, numpy and random on every node and rank (default 0).", 0, 2**63 - 1),
        "device": {
            "description": "auto (cuda if available, else mps, else cpu), cpu, cuda or cuda:N (default auto).",
            "type": "string",
            "anyOf": [{"pattern": anchored(plan_keys.DEVICE)}, {"pattern": VAR_INSIDE}],
            "default": "auto",
        },
        "replicas": {
            "description": "Data-parallel processes on this host; auto = one per GPU, else 1.",
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": plan_keys.MAX_REPLICAS},
                {"const": "auto"},
                VAR,
            ],
            "default": 1,
        },
        "parallel": {
            "description": "How replicas hold the model: ddp (default) a full copy each; fsdp "
                           "shards parameters, gradients and optimizer state over them (FSDP2).",
            "enum": list(plan_keys.PARALLEL),
            "default": "ddp",
        },
        "fsdp_layers": {
            "description": "With parallel: fsdp, the module classes (dotted paths) sharded as "
                           "units, each instance in the model; default: the model's direct "
                           "children that hold parameters.",
            "type": ["array", "null"],
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
        },
        "max_restarts": _int(
            "When a replica dies, restart every rank from the latest complete checkpoint, up to "
            "this many times (default 0: the job stops).", 0, plan_keys.MAX_RESTARTS),
        "vars": {
            "description": (
                'Values for "${name}" in any string of the plan; a value that is exactly '
                '"${name}" takes the var\'s type. Built in: '
                + ", ".join(f"${{{b}}}" for b in BUILTINS) + "."
            ),
            "type": ["object", "null"],
            "propertyNames": {"pattern": anchored(VAR_NAME), "not": {"enum": list(BUILTINS)}},
        },
        "max_epochs": {
            "description": "Stop after this epoch. A plan needs max_epochs, max_steps, stop_when "
            "or early_stop.",
            "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}, VAR],
        },
        "max_steps": {
            "description": (
                "Stop once the global step (optimizer steps taken) reaches this: every loop of "
                "the epoch ends at its next iteration, then the job ends as after its last epoch."
            ),
            "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}, VAR],
        },
        "stop_when": {
            "description": (
                "Outputs of epoch tasks; training stops after an epoch in which one is truthy."
            ),
            "anyOf": [BLOB, {"type": "array", "items": BLOB}, {"type": "null"}],
        },
        "early_stop": {
            "description": "Stop when an epoch-task output stops improving (e.g. val_loss).",
            "anyOf": [{"$ref": "#/$defs/early_stop"}, {"type": "null"}],
        },
        "checkpoint": {
            "description": "Checkpoint every few epochs; without it no checkpoints are written.",
            "anyOf": [{"$ref": "#/$defs/checkpoint"}, {"type": "null"}],
        },
        "loggers": {
            "description": "Experiment trackers that also receive the logged values, epoch "
                           "outputs, vars and the final model (mlflow and wandb are extras: "
                           'pip install "jobrun[mlflow]").',
            "anyOf": [{"enum": list(plan_keys.LOGGERS)},
                      {"type": "array", "items": {"enum": list(plan_keys.LOGGERS)}, "uniqueItems": True},
                      {"type": "null"}],
        },
        "init": _group("init", "Tasks run once before the first epoch (workspace global by default)."),
        "epoch": _group("epoch", "Tasks run every epoch, until a stop condition holds.", True),
        "download": _group(
            "download", "Tasks run once after the last epoch (e.g. gather parameters)."
        ),
        "exit": _group("exit", "Tasks run once at the very end (e.g. save the model)."),
    }


def _task() -> dict[str, Any]:
    known = {
        "task": {**NAME, "description": "The task's name, unique within its group."},
        "node": {**NAME, "description": "The node (machine and workspace) it runs on.", "default": "local"},
        "workspace": {
            "description": (
                "global: the node's workspace; private: a child workspace whose new blobs "
                "are dropped at the end, except `outputs` (default: global in init, else private)."
            ),
            "anyOf": [{"enum": ["global", "private"]}, VAR],
        },
        "instances": _int(
            "Concurrent copies of `do` sharing the task's workspace (default 1).",
            1,
            plan_keys.MAX_INSTANCES,
        ),
        "init": {**BLOCK, "description": "Steps run once before `do` (before all instances)."},
        "do": {**BLOCK, "description": "The task's steps."},
        "exit": {**BLOCK, "description": "Steps run once after `do`, also after stop_if."},
        "outputs": _names("Blobs handed to the runner when the task ends (stop_when reads them)."),
    }
    return {
        "description": "A body of steps that runs on one node.",
        "type": "object",
        "properties": _keyed(plan_keys.TASK_KEYS, known),
        "required": ["task", "do"],
        "additionalProperties": False,
    }


def _blob_list(description: str) -> dict[str, Any]:
    return {"description": description, "anyOf": [BLOB, {"type": "array", "items": BLOB}, {"type": "null"}]}


def _checkpoint() -> dict[str, Any]:
    known = {
        "dir": {
            "description": "Checkpoint directory, relative to the run directory.",
            "type": "string",
            "pattern": r"\S",
            "default": "checkpoints",
        },
        "every": _int("Save every this many epochs (default 1).", 1),
        "keep": {
            "description": "Keep the last K epochs (null: all).",
            "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}, VAR],
        },
        "upload": {
            "description": "After training, copy each node's last checkpoint to <upload>/<node>.",
            "anyOf": [{"type": "string", "pattern": r"\S"}, {"type": "null"}],
        },
        "async": {
            "description": "Write checkpoint files in the background; training is blocked only "
            "for the copy of the state to host memory (default false).",
            "anyOf": [{"type": "boolean"}, VAR],
        },
        "best": {
            "description": "Also keep the best epochs by an epoch-task output.",
            "anyOf": [{"$ref": "#/$defs/best"}, {"type": "null"}],
        },
        "include": _blob_list("Blobs saved besides those that steps after init write or change."),
        "exclude": _blob_list("Blobs never saved: init rebuilds them on resume."),
    }
    return {
        "description": "Checkpoint settings.",
        "type": "object",
        "properties": _keyed(plan_keys.CHECKPOINT_KEYS, known),
        "additionalProperties": False,
    }


def _watch(description: str, keys: tuple[str, ...], own: dict[str, Any]) -> dict[str, Any]:
    """`early_stop` and `checkpoint.best`: a monitored epoch-task output and its mode."""
    known = {
        "monitor": {**BLOB, "description": "An output of an epoch task (e.g. val_loss)."},
        "mode": {
            "description": "min: lower is better (a loss); max: higher is better (default min).",
            "anyOf": [{"enum": list(plan_keys.MODES)}, VAR],
            "default": "min",
        },
        **own,
    }
    return {
        "description": description,
        "type": "object",
        "properties": _keyed(keys, known),
        "required": ["monitor"],
        "additionalProperties": False,
    }


# -- steps -----------------------------------------------------------------------------




def _step() -> dict[str, Any]:
    """A step: the first control key present picks the kind, as in the compiler; else an op."""
    keys = plan_keys.CONTROL_KEYS
    rules: list[dict[str, Any]] = [
        {"if": {"required": [key]}, "then": {"$ref": f"#/$defs/{key}"}} for key in keys
    ]
    rules.append({
        "if": {"not": {"anyOf": [{"required": [key]} for key in keys]}},
        "then": {"$ref": "#/$defs/op_call"},
    })
    return {
        "description": "An op call `- OP: {in: ..., out: ..., ARG: ...}` or a control step.",
        "type": "object",
        "minProperties": 1,
        "allOf": rules,
    }


def _control_defs() -> dict[str, Any]:
    known = {
        "loop": _control(
            "Repeat `do` a number of times, or until a stop_if inside it fires.",
            {
                "loop": {
                    "description": "An integer, a blob holding one, or null: until stop_if.",
                    "anyOf": [{"type": "integer", "minimum": 0}, BLOB, {"type": "null"}, VAR],
                },
                "as": {
                    "description": "Blob receiving the 0-based iteration index.",
                    "anyOf": [BLOB, {"type": "null"}],
                },
                "do": {**BLOCK, "description": "The loop's body."},
                "id": STEP_ID, "every": EVERY,
            },
            ["loop", "do"],
        ),
        "stop_if": _control(
            "Truthy -> leave the innermost loop now; outside any loop, end the task's `do`.",
            {"stop_if": {**BLOB, "description": "The blob tested."}, "id": STEP_ID, "every": EVERY},
            ["stop_if"],
        ),
        "if": _control(
            "Run the first branch whose blob is truthy, else the `else` steps.",
            {
                "if": {**BLOB, "description": "The blob tested."},
                "then": {**BLOCK, "description": "Steps run when it is truthy."},
                "elif": {
                    "description": "Further conditions, tried in order.",
                    "type": ["array", "null"],
                    "items": _control(
                        "One more condition and its steps.",
                        {
                            "if": {**BLOB, "description": "The blob tested."},
                            "then": {**BLOCK, "description": "Steps run when it is truthy."},
                        },
                        ["if", "then"],
                    ),
                },
                "else": {**BLOCK, "description": "Steps run when no condition is truthy."},
                "id": STEP_ID, "every": EVERY,
            },
            ["if", "then"],
        ),
        "parallel": _control(
            "Branches that run concurrently; a blob must not be created by two of them.",
            {
                "parallel": {
                    "description": "The branches.",
                    "type": "array",
                    "items": _control(
                        "One branch.",
                        {
                            "name": {
                                "description": "Optional branch name, shown by `jobrun print`.",
                                "anyOf": [NAME, {"type": "null"}],
                            },
                            "do": {**BLOCK, "description": "The branch's steps."},
                        },
                        ["do"],
                    ),
                },
                "id": STEP_ID, "every": EVERY,
            },
            ["parallel"],
        ),
        "report": _control(
            "Run `do` every period in the background while the rest of the block runs, and "
            "once more when it ends.",
            {
                "report": {"$ref": "#/$defs/duration", "description": "The period: 500ms, 2s."},
                "do": {**BLOCK, "description": "The steps run every period."},
                "id": STEP_ID, "every": EVERY,
            },
            ["report", "do"],
        ),
    }
    # A control key the compiler gains before this module learns about it stays allowed.
    return {
        key: known.get(key, {"description": f"`{key}:` (not described yet)"})
        for key in plan_keys.CONTROL_KEYS
    }


def _control(description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "description": description,
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
