"""The keys a plan may hold at each place.

The compiler accepts exactly these, the JSON schema describes them, and an override
(`KEY=VALUE`) may set one that the plan leaves out without the `+` that new keys need.
"""

from __future__ import annotations

import re

TOP_KEYS = (
    "job", "seed", "device", "replicas", "parallel", "fsdp_layers", "max_restarts", "vars",
    "max_epochs", "max_steps", "stop_when",
    "early_stop", "checkpoint", "loggers", "init", "epoch", "download", "exit",
)
# Experiment trackers a plan may send its logged values to (`loggers: [...]`).
LOGGERS = ("csv", "mlflow", "wandb")
TASK_KEYS = ("task", "node", "workspace", "instances", "init", "do", "exit", "outputs")
CHECKPOINT_KEYS = ("dir", "every", "keep", "upload", "async", "best", "include", "exclude")
# `early_stop:` and `checkpoint.best:` watch an epoch-task output.
EARLY_STOP_KEYS = ("monitor", "mode", "patience", "min_delta")
BEST_KEYS = ("monitor", "mode", "keep")
MODES = ("min", "max")
# How replicas hold the model: each a full copy (ddp), or each a shard (fsdp: FSDP2).
PARALLEL = ("ddp", "fsdp")

# The keys that make a step a control step, in the order they are recognised, and the
# keys each kind of step takes. Any step may also have an `id` (see STEP_ID).
CONTROL_KEYS = ("loop", "stop_if", "if", "parallel", "report")
ID_KEY = "id"
# `every: N` runs a step at global steps 0, N, 2N, ... only (inside an op call's mapping,
# or beside a control step's keyword).
EVERY_KEY = "every"
STEP_KEYS = {
    "loop": ("loop", "as", "do", ID_KEY, EVERY_KEY),
    "stop_if": ("stop_if", ID_KEY, EVERY_KEY),
    "if": ("if", "then", "elif", "else", ID_KEY, EVERY_KEY),
    "parallel": ("parallel", ID_KEY, EVERY_KEY),
    "report": ("report", "do", ID_KEY, EVERY_KEY),
}
ELIF_KEYS = ("if", "then")
BRANCH_KEYS = ("name", "do")
# The reserved keys of an op call's mapping; the others are its arguments.
OP_IO_KEYS = ("in", "out", EVERY_KEY)

# A step id names a step within its task, so that an override can reach it
# (`epoch.train.step.clip_grad_norm=1`): no dots (they separate the parts of a path), and
# it must not read as a list index or a task key.
STEP_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}\Z")

# Names and limits of what a plan holds (the compiler checks them, the schema states them).
BLOB_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:/[A-Za-z_][A-Za-z0-9_]*)*\Z")
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
DEVICE = re.compile(r"(auto|cpu|cuda|cuda:\d{1,3})\Z")
DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)\s*\Z")
NAME_RULE = "1-64 letters, digits, '_', '.' or '-', starting with a letter or digit, without '..'"
BLOB_RULE = "letters, digits and _ (not starting with a digit); scopes joined by '/', e.g. enc/w"

MAX_INSTANCES = 1024
MAX_REPLICAS = 1024
MAX_RESTARTS = 1000
