"""Tasks and steps -> plan IR: the part of the compiler below the plan's top level.

:class:`StepCompiler` checks a task's keys and each step's structure (control steps, op
calls, their inputs and outputs, names and durations); :mod:`jobrun.plans.compile`
builds the plan around it. Every error is a PlanError at the value's file:line:col.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from jobrun.errors import PlanError, Pos, did_you_mean
from jobrun.ops.nested import NESTING_OPS, nested_inputs
from jobrun.plans import ir
from jobrun.plans.keys import (
    BLOB_NAME,
    BLOB_RULE,
    BRANCH_KEYS,
    CONTROL_KEYS,
    DURATION,
    ELIF_KEYS,
    EVERY_KEY,
    ID_KEY,
    MAX_INSTANCES,
    NAME_RULE,
    NODE_NAME,
    OP_NAME,
    STEP_ID,
    STEP_KEYS,
    TASK_KEYS,
)
from jobrun.plans.load import PList, PMap
from jobrun.plans.scalars import kind_of, parse_number, shorten, show

# The keys that only appear inside a control step (a step made of just `do:` lost its `loop:`).
_INNER_KEYS = {
    "do": "`loop:`, `report:` or a parallel branch",
    "then": "`if:`", "elif": "`if:`", "else": "`if:`", "as": "`loop:`",
}


def suggest(word: str, choices: Iterable[str]) -> str | None:
    return did_you_mean(word, choices, most=2)


class StepCompiler:
    """Checks and builds tasks and their steps; remembers names it has checked."""

    def __init__(self, source: str):
        self.source = source
        self.good_blobs: set[str] = set()  # names already checked: big plans repeat them
        self.good_ops: set[str] = set()
        self.control = {key: getattr(self, "step_" + key) for key in CONTROL_KEYS}
        self.ids: dict[str, Pos] = {}  # the step ids of the task being compiled
        self.task_name = ""

    # -- helpers ---------------------------------------------------------------------
    def keys(self, m: PMap, allowed: tuple[str, ...], what: str) -> None:
        for key in m:
            if key not in allowed:
                hint = suggest(key, allowed) or f"the keys of {what} are: {', '.join(allowed)}"
                raise PlanError(f"unknown key {show(key)} in {what}", m.key_at(key), hint)

    def mapping(self, value: Any, pos: Pos, what: str, example: str) -> PMap:
        if not isinstance(value, PMap):
            raise PlanError(f"{what} must be a mapping, not {kind_of(value)}", pos, f"write e.g. {example}")
        return value

    def seq(self, value: Any, pos: Pos, what: str, example: str) -> PList:
        if not isinstance(value, PList):
            raise PlanError(f"{what} must be a list, not {kind_of(value)}", pos, f"write e.g. {example}")
        return value

    def int_(self, value: Any, pos: Pos, what: str, lo: int, hi: int | None = None) -> int:
        bound = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        if isinstance(value, bool) or not isinstance(value, int):
            hint = f"write a whole number {bound}, without quotes, e.g. {what.rpartition('.')[2]}: {max(lo, 1)}"
            raise PlanError(f"{what} must be an integer, not {kind_of(value)}", pos, hint)
        if value < lo or (hi is not None and value > hi):
            raise PlanError(f"{what} is {value}; it must be {bound}", pos, f"use a value {bound}")
        return value

    def blob(self, value: Any, pos: Pos, what: str, op: str | None = None) -> ir.BlobRef:
        """A checked blob name; `what` names the place (with `op`: "`what` of `op`")."""
        if value.__class__ is not str or value not in self.good_blobs:
            self.check_blob(value, pos, f"`{what}` of `{op}`" if op is not None else what)
        return ir.BlobRef(value, pos)

    def check_blob(self, value: Any, pos: Pos, what: str) -> None:
        if not isinstance(value, str):
            raise PlanError(f"{what} must be a blob name, not {kind_of(value)}", pos, f"a blob name is {BLOB_RULE}")
        if not BLOB_NAME.match(value):
            raise PlanError(f"bad blob name {show(value)} in {what}", pos, f"a blob name is {BLOB_RULE}")
        self.good_blobs.add(value)

    def blobs(self, value: Any, pos: Pos, what: str) -> tuple[ir.BlobRef, ...]:
        if isinstance(value, PList):
            return tuple([self.blob(v, value.at(i), what) for i, v in enumerate(value)])
        if value is None:
            return ()
        return (self.blob(value, pos, what),)

    def name(self, value: Any, pos: Pos, what: str) -> str:
        if not isinstance(value, str):
            raise PlanError(f"the {what} must be a string, not {kind_of(value)}", pos, f"a {what} is {NAME_RULE}")
        if not NODE_NAME.match(value) or ".." in value:
            raise PlanError(f"bad {what} {show(value)}", pos, f"a {what} is {NAME_RULE}")
        return value


    # -- tasks -----------------------------------------------------------------------
    def group(self, name: str, value: Any, pos: Pos, key_pos: Pos) -> ir.Group:
        if value is None:
            return ir.Group(name, (), key_pos)
        if isinstance(value, PMap) and "task" in value:
            raise PlanError(
                f"group `{name}` must be a list of tasks, not one mapping", pos,
                f"start the task with a dash: `{name}:` then `  - task: {value['task']}`",
            )
        tasks = self.seq(value, pos, f"group `{name}`", f"{name}: [{{task: t, do: [...]}}]")
        out: list[ir.Task] = []
        seen: dict[str, Pos] = {}
        for i, item in enumerate(tasks):
            task = self.task(name, item, tasks.at(i))
            if task.name in seen:
                first = seen[task.name]
                raise PlanError(
                    f"task {task.name!r} appears twice in group `{name}` (first at line {first.line}, column {first.col})",
                    task.pos,
                    "give each task of a group its own name",
                )
            seen[task.name] = task.pos
            out.append(task)
        return ir.Group(name, tuple(out), key_pos)

    def task(self, group: str, value: Any, pos: Pos) -> ir.Task:
        m = self.mapping(value, pos, f"a task of `{group}`", "- task: train\n    do: [...]")
        if "task" not in m:
            raise PlanError(f"a task of `{group}` has no `task` name", m.pos, "add `task: NAME`")
        name = self.name(m["task"], m.at("task"), "task name")
        where = f"task {name!r}"
        self.keys(m, TASK_KEYS, where)
        node = self.name(m.get("node", "local"), m.at("node"), "node name")
        ws = m.get("workspace", "global" if group == "init" else "private")
        if not isinstance(ws, str) or ws not in ("global", "private"):
            raise PlanError(f"bad workspace {show(ws)} in {where}", m.at("workspace"), "use global or private")
        instances = self.int_(m.get("instances", 1), m.at("instances"), "instances", 1, MAX_INSTANCES)
        if "do" not in m:
            raise PlanError(f"{where} has no `do` steps", m.key_at("task"), "add `do: [STEP, ...]`")
        self.ids, self.task_name = {}, where
        return ir.Task(
            name=name, group=group, node=node, workspace=ws, instances=instances,
            init=self.block(m.get("init"), m.at("init"), f"{where} init"),
            do=self.block(m["do"], m.at("do"), f"{where} do"),
            exit=self.block(m.get("exit"), m.at("exit"), f"{where} exit"),
            outputs=self.blobs(m.get("outputs"), m.at("outputs"), "outputs"),
            pos=m.pos,
        )

    # -- steps -----------------------------------------------------------------------
    def block(self, value: Any, pos: Pos, what: str) -> tuple[ir.Step, ...]:
        if value is None:
            return ()
        if not isinstance(value, PList):
            self.seq(value, pos, what, "do: [{add: {in: [a, b], out: c}}]")
        step = self.step
        return tuple([step(s, value, i) for i, s in enumerate(value)])

    def step(self, value: Any, parent: PList, i: int) -> ir.Step:
        # The step's item position serves only errors: an op call is placed at its name,
        # a control step at its keyword.
        if isinstance(value, PMap) and len(value) == 1:
            (name,) = value
            if name not in CONTROL_KEYS and name not in _INNER_KEYS and name != ID_KEY:
                return self.op(value, name)
        if not isinstance(value, PMap):
            if isinstance(value, str):
                raise PlanError(
                    f"step {show(value)} is a bare word",
                    parent.at(i),
                    f"an op call is a mapping: `- {shorten(value)}: {{in: ..., out: ...}}`",
                )
            self.mapping(value, parent.at(i), "a step", "- add: {in: [a, b], out: c}")
        m: PMap = value
        step_id = self.step_id(m) if ID_KEY in m else None
        for key in CONTROL_KEYS:
            if key in m:
                step = self.control[key](m, step_id)
                if EVERY_KEY in m:
                    step = dataclasses.replace(step, every=self.every(m[EVERY_KEY], m.at(EVERY_KEY)))
                return step
        if not m:
            raise PlanError(
                "empty step", parent.at(i), "write an op call (- add: {in: [a, b], out: c}) or a control step"
            )
        others = [k for k in m if k != ID_KEY]
        if step_id is not None and len(others) == 1 and others[0] not in _INNER_KEYS:
            return self.op(m, others[0], step_id)
        if not others:
            raise PlanError(
                "a step has an `id` but nothing to do", m.key_at(ID_KEY),
                "put the id beside an op or a control step: `- train.step: {...}` then `  id: step`",
            )
        inner = next((k for k in m if k in _INNER_KEYS), None)
        if inner is not None:
            for key in others:  # `reprot: 10s` beside its `do:`: the keyword is misspelt
                if key not in _INNER_KEYS and key != EVERY_KEY:
                    _misspelt_keyword(key, m.key_at(key))
            raise PlanError(
                f"`{inner}:` belongs to {_INNER_KEYS[inner]}, which this step lacks",
                m.key_at(inner),
                f"add the missing key to this step, or indent `{inner}:` under it",
            )
        keys = list(m)
        raise PlanError(
            f"an op call has exactly one key (the op's name); this step has {len(keys)}: {', '.join(keys)}",
            m.key_at(keys[1]),
            "put the arguments inside the op's mapping: `- add: {in: [a, b], out: c}`",
        )

    def step_id(self, m: PMap) -> str:
        """A step's `id`, checked: well formed and unique in its task."""
        value, pos = m[ID_KEY], m.at(ID_KEY)
        if not isinstance(value, str) or not STEP_ID.match(value) or value in TASK_KEYS:
            shown = show(value) if isinstance(value, str) else kind_of(value)
            why = f"; {value!r} is a task key" if value in TASK_KEYS else ""
            raise PlanError(
                f"bad step id {shown}{why}", pos,
                "an id is 1-64 letters, digits, '_' or '-', starting with a letter or '_', "
                "no dots, and not a task key",
            )
        first = self.ids.setdefault(value, pos)
        if first is not pos:
            raise PlanError(
                f"step id {value!r} appears twice in {self.task_name} (first at line {first.line}, "
                f"column {first.col})", pos, "give each step of a task its own id",
            )
        return value

    def every(self, value: Any, pos: Pos) -> int | None:
        """`every: N` of a step (null: every time)."""
        return None if value is None else self.int_(value, pos, "every", 1)

    def op(self, m: PMap, name: str, step_id: str | None = None) -> ir.OpCall:
        pos = m.key_at(name)
        if name not in self.good_ops:
            if not OP_NAME.match(name):
                raise PlanError(f"bad op name {show(name)}", pos, "op names are words joined by '.', e.g. train.step")
            self.good_ops.add(name)
        body = m[name]
        if body is None:
            body = PMap(m.at(name))
        elif not isinstance(body, PMap):
            _misspelt_keyword(name, pos)  # `paralel: [...]` is no op call at all
            if isinstance(body, str | int | float) and not isinstance(body, bool):
                hint = f"write `- {name}: {{in: {body}}}`, or `{{out: {body}}}`"
            else:
                hint = f"write `- {name}: {{in: [a], out: b}}`"
            self.mapping(body, m.at(name), f"the arguments of `{name}`", hint.removeprefix("write "))
        # The hot loop of compiling a big plan: names already checked skip the checks.
        ins: tuple[ir.Input, ...] = ()
        outs: tuple[ir.BlobRef, ...] = ()
        args: list[tuple[str, Any]] | None = None
        every: int | None = None
        good = self.good_blobs
        ref = ir.BlobRef
        for key, value in body.items():
            if key == "in":
                if isinstance(value, PList):
                    at = value.at
                    ins = tuple([
                        ref(v, at(i)) if v.__class__ is str and v in good else self.input(name, v, at(i))
                        for i, v in enumerate(value)
                    ])
                elif value is not None:
                    ins = (self.input(name, value, body.at("in")),)
            elif key == "out":
                if isinstance(value, PList):
                    at = value.at
                    outs = tuple([
                        ref(v, at(i)) if v.__class__ is str and v in good else self.blob(v, at(i), "out", name)
                        for i, v in enumerate(value)
                    ])
                elif value is not None:
                    outs = (self.blob(value, body.at("out"), "out", name),)
            elif key == EVERY_KEY:
                every = self.every(value, body.at(key))
            elif args is None:
                args = [(key, value)]
            else:
                args.append((key, value))
        if args is None:
            return ir.OpCall(name, ins, outs, (), pos, (), step_id, every)
        arg_pos = tuple([(k, body.at(k)) for k, _ in args])
        key_pos = tuple([(k, body.key_at(k)) for k, _ in args])
        if name in NESTING_OPS:
            ins = ins + self.nested(name, args)
        return ir.OpCall(name, ins, outs, tuple(args), pos, arg_pos, step_id, every, key_pos)

    def nested(self, op: str, args: list[tuple[str, Any]]) -> tuple[ir.Input, ...]:
        """The blobs nested targets name with `in` (see jobrun.ops.nested), as inputs."""
        kwargs = dict(args)
        found = nested_inputs(kwargs.get("args"), kwargs)
        refs: list[ir.Input] = []
        for item, container, key in found:
            at = container.at(key) if isinstance(container, PList | PMap) else Pos("<plan>")
            if item.__class__ is not str:
                raise PlanError(
                    f"`in` of a nested target names blobs; {kind_of(item)} is not a blob name",
                    at, "give literal values as `args` or keyword arguments of the target",
                )
            refs.append(self.blob(item, at, "in", op))
        return tuple(refs)

    def input(self, op: str, item: Any, pos: Pos) -> ir.Input:
        if item.__class__ is str:
            if item not in self.good_blobs and not BLOB_NAME.match(item) and parse_number(item) is not None:
                raise PlanError(
                    f"`in` of `{op}` names the blob {show(item)}, which is a quoted number",
                    pos, f"write {item.strip()} without quotes: in `in` a string is a blob name "
                    "(so is the value of a var that holds a string)",
                )
            return self.blob(item, pos, "in", op)
        if isinstance(item, bool | int | float):
            return ir.Literal(item, pos)
        if item is None:
            raise PlanError(f"`in` of `{op}` has a null", pos, "give a blob name or a number")
        raise PlanError(
            f"an input of `{op}` must be a blob name or a number, not {kind_of(item)}", pos,
            "`in` takes a blob name, a number, or a flat list of them: in: [a, 1]",
        )

    def step_loop(self, m: PMap, step_id: str | None) -> ir.Loop:
        self.keys(m, STEP_KEYS["loop"], "a loop")
        raw, pos = m["loop"], m.at("loop")
        count: int | ir.BlobRef | None
        if raw is None:
            count = None
        elif isinstance(raw, bool | float):
            raise PlanError(
                f"loop count must be a whole number, a blob name or null, not {kind_of(raw)}", pos,
                "write e.g. loop: 10, loop: n_steps or loop: null (until stop_if)",
            )
        elif isinstance(raw, int):
            count = self.int_(raw, pos, "loop count", 0)
        elif isinstance(raw, str):
            if raw.strip().lstrip("+-").replace(".", "", 1).isdigit():
                raise PlanError(
                    f"loop count {show(raw)} is a quoted string, not a number", pos,
                    "write a whole number without quotes, e.g. loop: 10",
                )
            count = self.blob(raw, pos, "loop count")
        else:
            raise PlanError(
                f"loop count must be a whole number, a blob name or null, not {kind_of(raw)}", pos,
                "write e.g. loop: 10",
            )
        index = self.blob(m["as"], m.at("as"), "loop `as`") if m.get("as") is not None else None
        if "do" not in m:
            raise PlanError("loop has no `do` steps", m.key_at("loop"), "add `do: [STEP, ...]` to the loop")
        return ir.Loop(count, index, self.block(m["do"], m.at("do"), "loop do"), m.key_at("loop"), step_id)

    def step_stop_if(self, m: PMap, step_id: str | None) -> ir.StopIf:
        self.keys(m, STEP_KEYS["stop_if"], "stop_if")
        return ir.StopIf(self.blob(m["stop_if"], m.at("stop_if"), "stop_if"), m.key_at("stop_if"), step_id)

    def step_if(self, m: PMap, step_id: str | None) -> ir.If:
        if "then" not in m and "do" in m:
            raise PlanError("an `if` runs `then:` steps, not `do:`", m.key_at("do"), "rename `do:` to `then:`")
        self.keys(m, STEP_KEYS["if"], "an if")  # `than:` is a typo, not a missing `then:`
        if "then" not in m:
            raise PlanError("`if` has no `then` steps", m.key_at("if"), "add `then: [STEP, ...]` to the if")
        branches = [
            ir.IfBranch(
                self.blob(m["if"], m.at("if"), "if"),
                self.block(m["then"], m.at("then"), "then"),
                m.key_at("if"),
            )
        ]
        if m.get("elif") is not None:
            elifs = self.seq(m["elif"], m.at("elif"), "elif", "elif: [{if: c2, then: [...]}]")
            for i, item in enumerate(elifs):
                e = self.mapping(item, elifs.at(i), "an elif", "{if: c2, then: [...]}")
                self.keys(e, ELIF_KEYS, "an elif")
                if "if" not in e or "then" not in e:
                    raise PlanError("an elif needs `if` and `then`", e.pos, "write {if: c2, then: [...]}")
                branches.append(
                    ir.IfBranch(
                        self.blob(e["if"], e.at("if"), "elif"),
                        self.block(e["then"], e.at("then"), "then"),
                        e.key_at("if"),
                    )
                )
        orelse = self.block(m["else"], m.at("else"), "else") if "else" in m else None
        return ir.If(tuple(branches), orelse, m.key_at("if"), step_id)

    def step_parallel(self, m: PMap, step_id: str | None) -> ir.Parallel:
        self.keys(m, STEP_KEYS["parallel"], "parallel")
        items = self.seq(m["parallel"], m.at("parallel"), "parallel", "parallel: [{do: [...]}, {do: [...]}]")
        branches = []
        names: dict[str, Pos] = {}
        for i, item in enumerate(items):
            b = self.mapping(item, items.at(i), "a parallel branch", "{name: left, do: [...]}")
            self.keys(b, BRANCH_KEYS, "a parallel branch")
            if "do" not in b:
                raise PlanError("a parallel branch has no `do` steps", b.pos, "add `do: [STEP, ...]`")
            bname = None
            if b.get("name") is not None:
                bname = self.name(b["name"], b.at("name"), "branch name")
                if bname in names:
                    raise PlanError(
                        f"two parallel branches are named {bname!r} (first at line {names[bname].line})",
                        b.at("name"), "give each branch its own name",
                    )
                names[bname] = b.at("name")
            branches.append(ir.Branch(bname, self.block(b["do"], b.at("do"), "branch do"), b.pos))
        return ir.Parallel(tuple(branches), m.key_at("parallel"), step_id)

    def step_report(self, m: PMap, step_id: str | None) -> ir.Report:
        self.keys(m, STEP_KEYS["report"], "a report")
        period, text = parse_duration(m["report"], m.at("report"))
        if "do" not in m:
            raise PlanError("report has no `do` steps", m.key_at("report"), "add `do: [STEP, ...]` to the report")
        return ir.Report(period, text, self.block(m["do"], m.at("do"), "report do"), m.key_at("report"), step_id)


def _misspelt_keyword(word: str, pos: Pos) -> None:
    """Refuse `word` when it is a control step's keyword misspelt (`paralel`, `reprot`,
    `iff`) and no op's name: else its step is taken for an op call, or its `do:` for a
    stray key, and the message says nothing of the keyword."""
    near = did_you_mean(word, CONTROL_KEYS, most=2)
    if near is None:
        return
    from jobrun.ops.registry import registry  # data only; read on this error path alone

    if word not in registry():
        raise PlanError(f"unknown step keyword {show(word)}", pos,
                        f"{near} (the control steps are {', '.join(CONTROL_KEYS)})")


def parse_duration(raw: Any, pos: Pos) -> tuple[float, str]:
    """'500ms' / '2s' / '1.5s' -> (seconds, text as written)."""
    match = DURATION.match(raw) if isinstance(raw, str) else None
    if not match:
        shown = show(raw) if isinstance(raw, str) else kind_of(raw)
        unitless = isinstance(raw, int | float) and not isinstance(raw, bool) or (
            isinstance(raw, str) and raw.strip().replace(".", "", 1).isdigit()
        )
        hint = (
            f"add a unit: {raw}s or {raw}ms" if unitless else "write a duration with a unit: 500ms or 2s"
        )
        raise PlanError(f"bad report duration {shown}", pos, hint)
    number, unit = float(match.group(1)), match.group(2)
    seconds = number / 1000 if unit == "ms" else number
    if not 0.001 <= seconds <= 86400:
        raise PlanError(f"report period {show(raw)} is out of range", pos, "use 1ms to 86400s")
    return seconds, raw.strip()
