"""`KEY=VALUE` overrides (`--set`, and the positional ones of `train` and `resume`).

    apply_sets(tree, ["max_epochs=3", "vars.lr=0.05", "+vars.warmup=100",
                      "epoch.train.train.step.clip_grad_norm=1.0"])

KEY is a dotted path through the plan; VALUE is any YAML value (empty: null). Where the
path is decides what a part means:

* in a mapping, a key (op names have dots: the longest key the parts spell wins);
* in a list, an index; in a group (`epoch`, ...) also a task's name, among parallel
  branches a branch's name;
* in a task or a control step, after their own keys, and in a list of steps: a step, by
  its `id` first, else by its op's name, searched through the nested bodies of loops,
  ifs, parallels and reports. A name that fits several steps is an error that lists them
  with their index paths. An op call is entered at its arguments, a control step at its
  keys (`epoch.train.inner.loop=20`).

The path must exist in the plan, except where the plan's schema knows the missing key at
that place: an optional setting (`max_epochs=3` in a plan without it, `checkpoint.keep`),
a task's or a step's key, an argument of the op. Anything else is taken for a typo:
`vars.lrr=0.5` is an error with a "did you mean". As in Hydra, `+KEY=VALUE` adds a new
key on purpose (and is refused for a key that exists); `++KEY=VALUE` adds or changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jobrun.errors import PlanError, Pos
from jobrun.plans.keys import (
    BEST_KEYS,
    BRANCH_KEYS,
    CHECKPOINT_KEYS,
    CONTROL_KEYS,
    EARLY_STOP_KEYS,
    ELIF_KEYS,
    ID_KEY,
    OP_IO_KEYS,
    STEP_KEYS,
    TASK_KEYS,
    TOP_KEYS,
)
from jobrun.plans.load import MAX_DEPTH, PList, PMap, nesting, parse_value
from jobrun.plans.scalars import kind_of

GROUPS = ("init", "epoch", "download", "exit")
# What the value under a key is, by the kind of mapping that holds it.
_CHILD = {
    "plan": {**dict.fromkeys(GROUPS, "group"), "checkpoint": "checkpoint", "early_stop": "early_stop"},
    "checkpoint": {"best": "best"},
    "task": {"init": "block", "do": "block", "exit": "block"},
    "step": {"do": "block", "then": "block", "else": "block", "elif": "elifs", "parallel": "branches"},
    "elif": {"then": "block"},
    "branch": {"do": "block"},
}
# What the items of a list are, by the kind of list.
_ITEM = {"group": "task", "block": "step", "elifs": "elif", "branches": "branch"}
# The keys the schema knows in each kind of mapping (a step's depend on its kind).
_KNOWN = {
    "plan": TOP_KEYS, "checkpoint": CHECKPOINT_KEYS, "best": BEST_KEYS, "early_stop": EARLY_STOP_KEYS,
    "task": TASK_KEYS, "elif": ELIF_KEYS, "branch": BRANCH_KEYS,
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def apply_sets(tree: PMap, sets: list[str] | tuple[str, ...]) -> None:
    """Apply `KEY=VALUE` overrides in order (see the module doc); PlanError on a bad one."""
    for item in sets:
        _Override(item).apply(tree)


class _At:
    """Where the walk is: a container of the plan, what kind it is, how many parts of the
    key led here, the index path to it (for messages) and its position. (A plain class:
    a dataclass would cost `jobrun print` milliseconds of start-up to define.)"""

    __slots__ = ("node", "kind", "depth", "trail", "pos", "op")

    def __init__(self, node: Any, kind: str, depth: int, trail: list[str], pos: Pos, op: str | None = None):
        self.node = node
        self.kind = kind
        self.depth = depth
        self.trail = trail
        self.pos = pos
        self.op = op  # in an op call's arguments: the op's name


class _Override:
    def __init__(self, item: str):
        self.where = Pos(f"--set {item}")
        key, eq, self.raw = item.partition("=")
        key = key.strip()
        # Hydra's prefixes: +KEY adds a new key, ++KEY adds or changes one.
        written, plusses = key, len(key) - len(key.lstrip("+"))
        self.force, self.plus = plusses == 2, plusses == 1
        key = key[plusses:].strip()
        if not eq or not key:
            raise PlanError(f"--set {item!r} is not KEY=VALUE", self.where, "write e.g. --set max_epochs=3")
        if plusses > 2 or key.startswith("+"):
            bare = written.lstrip("+ ")
            raise PlanError(
                f"--set key {written!r} starts with {written[:len(written) - len(bare)]!r}: only + or ++ may start a key",
                self.where, f"+KEY adds a new key, ++KEY adds or changes one: e.g. ++{bare}=...",
            )
        try:
            self.value = parse_value(self.raw, str(self.where))
        except PlanError as e:
            raise PlanError(
                f"--set value {self.raw!r} of {key!r}: {e.message}", self.where,
                e.hint or "quote strings with special characters",
            ) from None
        self.parts = [p.strip() for p in key.split(".")]
        if any(not p for p in self.parts):
            raise PlanError(f"--set key {key!r} has an empty part", self.where, "write a dotted path, e.g. vars.lr")
        # The loader bounds how deep a plan nests (deep trees overflow the stack of
        # everything that walks them); a --set must not get around it.
        if len(self.parts) + nesting(self.value) > MAX_DEPTH:
            raise PlanError(
                f"--set {key!r} nests values more than {MAX_DEPTH} levels deep", self.where,
                "use a shorter path or a flatter value",
            )

    def fail(self, message: str, pos: Pos, hint: str) -> PlanError:
        return PlanError(f"{self.where}: {message}", pos, hint)

    def path(self, end: int) -> str:
        return ".".join(self.parts[:end])

    # -- the walk ----------------------------------------------------------------------
    def apply(self, tree: PMap) -> None:
        at: _At | None = _At(tree, "plan", 0, [], tree.pos)
        while at is not None:
            if at.depth == len(self.parts):
                raise self.fail(
                    f"{self.path(at.depth)} is a {'task' if at.kind == 'task' else 'step'}, not a value",
                    at.pos, f"name one of its keys or arguments, e.g. {self.path(at.depth)}.{_some_key(at)}=...",
                )
            if isinstance(at.node, dict):
                at = self.through_mapping(at)
            elif isinstance(at.node, list):
                at = self.through_list(at)
            else:
                parent = self.path(at.depth) or "the plan"
                raise self.fail(
                    f"{parent} is {kind_of(at.node)}, not a mapping or list, so it has no "
                    f"{self.parts[at.depth]!r}", at.pos, f"set {parent} itself: --set {parent}=VALUE",
                )

    def through_mapping(self, at: _At) -> _At | None:
        """One part through a mapping: a key, or a step nested in a task or control step.
        None when the value was set."""
        node, depth = at.node, at.depth
        _join_dotted_key(node, self.parts, depth)
        part = self.parts[depth]
        if at.kind in ("task", "step") and part not in node and part not in self.known(at):
            found = self.find_step(at, list(_bodies(at)), quiet=self.plus or self.force)
            if found is not None:
                return found
        if depth == len(self.parts) - 1:
            self.set_key(at, part)
            return None
        if part not in node:
            self.may_add(at, part)
        if node.get(part) is None:  # absent, or null in the plan: a mapping to go on in
            node[part] = PMap(self.where)
            self.placed(node, part)
        child = node[part]
        kind = "value"
        if at.kind == "step" and _step_kind(node) == "op" and part != ID_KEY:
            kind = "args"
        elif at.kind in _CHILD:
            kind = _CHILD[at.kind].get(part, "value")
        pos = _own_pos(child, node.at(part) if isinstance(node, PMap) else at.pos)
        return _At(child, kind, depth + 1, [*at.trail, part], pos, op=part if kind == "args" else None)

    def through_list(self, at: _At) -> _At | None:
        """One part through a list: an index, or a task, step or branch name."""
        items, depth = at.node, at.depth
        part = self.parts[depth]
        if part.isascii() and part.isdigit() and int(part) < len(items):  # not '²', which int() refuses
            idx = int(part)
            if depth == len(self.parts) - 1:
                self.set_item(at, idx)
                return None
            return self.item(at, idx, depth + 1)
        if not part.isdigit():
            if at.kind == "group":
                return self.find_task(at)
            if at.kind == "block":
                return self.find_step(at, [([], items)])
            if at.kind == "branches":
                names = [b.get("name") if isinstance(b, dict) else None for b in items]
                if part in names:
                    return self.item(at, names.index(part), depth + 1)
        n = len(items)
        parent = self.path(depth) or "the plan"
        raise self.fail(
            f"{self.path(depth + 1)!r} does not exist: {parent} is a list of {n} item{'s' * (n != 1)}",
            at.pos, f"use an index from 0 to {n - 1}" if items else f"{parent} is empty",
        )

    def item(self, at: _At, idx: int, depth: int) -> _At:
        child = at.node[idx]
        pos = _own_pos(child, at.node.at(idx) if isinstance(at.node, PList) else at.pos)
        return _At(child, _ITEM.get(at.kind, "value"), depth, [*at.trail, str(idx)], pos)

    # -- names ---------------------------------------------------------------------------
    def find_task(self, at: _At) -> _At:
        items, depth = at.node, at.depth
        names = [t.get("task") if isinstance(t, dict) else None for t in items]
        for end in range(len(self.parts), depth, -1):  # task names may have dots too
            name = ".".join(self.parts[depth:end])
            if name in names:
                return self.item(at, names.index(name), end)
        group = self.path(depth)
        known = [n for n in names if isinstance(n, str)]
        raise self.fail(
            f"group `{group}` has no task {self.parts[depth]!r}", at.pos,
            _close(self.parts[depth], known, f"{group}.")
            or f"its tasks: {', '.join(known) or 'none'}; or give the task's index (0 to {len(items) - 1})",
        )

    def find_step(self, at: _At, bodies: list[tuple[list[str], Any]], quiet: bool = False) -> _At | None:
        """The one step of `bodies` (and the bodies nested in them) that the next part(s)
        name: by `id`, else by op name. `quiet`: None when none does (a `+` key)."""
        depth = at.depth
        steps = [(trail, m) for prefix, body in bodies for trail, m in _steps(body, prefix)]
        part = self.parts[depth]
        matches = [(t, m) for t, m in steps if m.get(ID_KEY) == part]
        end = depth + 1
        if not matches:
            for end in range(len(self.parts), depth, -1):  # op names have dots
                name = ".".join(self.parts[depth:end])
                matches = [(t, m) for t, m in steps if _step_kind(m) == "op" and _op_name(m) == name]
                if matches:
                    break
        if not matches:
            if quiet:
                return None
            raise self.fail(f"{self.path(depth)} has no {'key or ' if isinstance(at.node, dict) else ''}step "
                            f"named {part!r}", at.pos, self.no_step_hint(at, steps))
        if len(matches) > 1:
            shown = "; ".join(f"{'.'.join([*at.trail, *t, _op_name(m) if _step_kind(m) == 'op' else ''])}"
                              .rstrip(".") + f" ({_step_pos(m)})" for t, m in matches)
            name = ".".join(self.parts[depth:end])
            raise self.fail(
                f"{name!r} names {len(matches)} steps of {self.path(depth)}: {shown}", at.pos,
                "write the index path of the one you mean, or give it an `id:` (beside the op's "
                "name) and use that",
            )
        trail, m = matches[0]
        trail = [*at.trail, *trail]
        if _step_kind(m) != "op":
            return _At(m, "step", end, trail, _step_pos(m))
        op = _op_name(m)
        if end == len(self.parts):
            raise self.fail(
                f"{self.path(end)} is a step, not a value", _step_pos(m),
                f"name one of its arguments, e.g. {self.path(end)}.{_some_key(_At(m[op], 'args', 0, [], m.pos, op))}=...",
            )
        if m[op] is None:  # `- copy:` with no arguments yet
            m[op] = PMap(self.where)
            self.placed(m, op)
        return _At(m[op], "args", end, [*trail, op], _own_pos(m[op], _step_pos(m)), op=op)

    def no_step_hint(self, at: _At, steps: list[tuple[list[str], dict]]) -> str:
        """What a task, a step or a list of steps has that the next part may have meant:
        its keys (an op step's: its op, whose arguments go under it), its steps, or an
        index."""
        where, part, node = self.path(at.depth), self.parts[at.depth], at.node
        names = sorted({str(m[ID_KEY]) for _, m in steps if ID_KEY in m}
                       | {_op_name(m) for _, m in steps if _step_kind(m) == "op"})
        keys = [*map(str, node), *(k for k in self.known(at) if k not in node)] if isinstance(node, dict) else []
        op = _op_name(node) if _step_kind(node) == "op" else None
        if op is not None and part in _op_keys(op):  # an argument written without its op
            return f"did you mean '{where}.{op}.{part}'? (an op's arguments go under its name)"
        close = _close(part, [*names, *keys], f"{where}.")
        if close:
            return close
        if op is not None:
            return (f"{where} is the step `{op}`; its keys: {', '.join(keys)}; `{op}`'s arguments go "
                    f"under it ({where}.{op}.{_some_key(_At(node[op], 'args', 0, [], at.pos, op))}=...)")
        said = [*([f"its keys: {', '.join(keys)}"] if keys else []),
                f"its steps: {', '.join(names) or 'none'} (by id or op name)"]
        if isinstance(node, list) and node:
            said.append(f"or give the step's index (0 to {len(node) - 1})")
        return "; ".join(said)

    # -- setting -------------------------------------------------------------------------
    def set_key(self, at: _At, part: str) -> None:
        node = at.node
        if part in node and self.plus:
            path = ".".join(self.parts)
            raise self.fail(
                f"{path} already exists in the plan; + only adds new keys",
                _own_pos(node, at.pos) if not isinstance(node, PMap) else node.at(part),
                f"drop the + to change it: {path}={self.raw}",
            )
        if at.trail == ["vars"] and part in node and not self.force:
            self.same_kind(node, part, at)
        if part not in node:
            self.may_add(at, part)
        node[part] = self.value
        self.placed(node, part)

    def same_kind(self, node: dict, part: str, at: _At) -> None:
        """A var that is a number in the plan takes a number: `vars.hidden=wide` reached
        user code (a model's constructor) and failed there, after a run directory was
        made and torch imported. `++` sets another kind on purpose."""
        old, new = node[part], self.value
        if _is_number(old) and not (_is_number(new) or new is None):  # null: "off"
            raise self.fail(
                f"vars.{part} is a number in the plan ({old!r}), not {kind_of(new)}",
                node.at(part) if isinstance(node, PMap) else at.pos,
                f"give a number, e.g. vars.{part}={old!r}; ++vars.{part}={self.raw} sets it anyway",
            )

    def set_item(self, at: _At, idx: int) -> None:
        if self.plus:
            raise self.fail(
                f"item {idx} of {self.path(at.depth)} exists; + only adds new keys to a mapping",
                at.pos, f"drop the + to change it: {'.'.join(self.parts)}={self.raw}",
            )
        at.node[idx] = self.value
        if isinstance(at.node, PList):
            _pad(at.node.item_pos, len(at.node), at.node.pos)[idx] = self.where

    def placed(self, node: dict, part: str) -> None:
        if isinstance(node, PMap):
            node.val_pos[part] = self.where
            node.key_pos.setdefault(part, self.where)

    def may_add(self, at: _At, part: str) -> None:
        """Refuse a key the plan lacks, unless `+` asks for it or the schema knows it here."""
        known = self.known(at)
        if self.plus or self.force or part in known:
            return
        parent = self.path(at.depth)
        choices = [str(k) for k in at.node] + [k for k in known if k not in at.node]
        close = _close(part, choices, f"{parent}." if parent else "")
        plan_vars = at.node.get("vars") if not parent and isinstance(at.node, dict) else None
        if not close and isinstance(plan_vars, dict) and part in plan_vars:  # lr=0.05 for vars.lr
            close = f"did you mean 'vars.{part}'? (vars.{part}={self.raw})"
        hint = close or (
            f"{parent or 'the plan'} has: {', '.join(choices)}" if choices else f"{parent} is empty"
        )
        # `+` only where a new key can mean something: never in a mapping whose keys the
        # plan format fixes (max_epoch), nor for a near miss of an op's argument; a var
        # (a free mapping) may be new even beside a near miss (vars.lrr beside vars.lr).
        # An op that passes any key on to code (build's target, call's fn) may take a new one.
        adds = at.kind not in _KNOWN and at.kind != "step" and (
            not close or at.kind == "value" or (at.kind == "args" and _takes_any_key(at.op)))
        raise self.fail(
            f"{self.path(at.depth + 1)} does not exist in the plan", at.pos,
            _then(hint, f"to add a new key, write +{'.'.join(self.parts)}={self.raw}" if adds else ""),
        )

    def known(self, at: _At) -> tuple[str, ...]:
        """The keys the schema knows in this mapping (those an override may add without +)."""
        if at.kind == "args":
            return _op_keys(at.op)
        if at.kind == "step":
            kind = _step_kind(at.node)
            return STEP_KEYS.get(kind or "", (ID_KEY,))
        return _KNOWN.get(at.kind, ())


# -- steps -------------------------------------------------------------------------------


def _step_kind(m: Any) -> str | None:
    """A step mapping's kind: a control key, "op", or None (not a step the compiler takes)."""
    if not isinstance(m, dict):
        return None
    for key in CONTROL_KEYS:
        if key in m:
            return key
    return "op" if len([k for k in m if k != ID_KEY]) == 1 else None


def _op_name(m: dict) -> str:
    return next(k for k in m if k != ID_KEY)


def _step_pos(m: Any) -> Pos:
    if not isinstance(m, PMap):
        return Pos("<plan>")
    kind = _step_kind(m)
    return m.key_at(_op_name(m) if kind == "op" else kind) if kind else m.pos


def _bodies(at: _At) -> Iterator[tuple[list[str], Any]]:
    """The lists of steps directly in a task or control step, with their index paths."""
    m = at.node
    if at.kind == "task":
        for key in ("init", "do", "exit"):
            yield [key], m.get(key)
    else:
        yield from _nested(m)


def _nested(m: dict) -> Iterator[tuple[list[str], Any]]:
    kind = _step_kind(m)
    if kind in ("loop", "report"):
        yield ["do"], m.get("do")
    elif kind == "if":
        yield ["then"], m.get("then")
        elifs = m.get("elif")
        for k, e in enumerate(elifs if isinstance(elifs, list) else []):
            if isinstance(e, dict):
                yield ["elif", str(k), "then"], e.get("then")
        yield ["else"], m.get("else")
    elif kind == "parallel":
        branches = m.get("parallel")
        for k, b in enumerate(branches if isinstance(branches, list) else []):
            if isinstance(b, dict):
                yield ["parallel", str(k), "do"], b.get("do")


def _steps(body: Any, prefix: list[str]) -> Iterator[tuple[list[str], dict]]:
    """Every step in `body` and in the bodies nested in its steps, in source order."""
    if not isinstance(body, list):
        return
    for i, m in enumerate(body):
        if _step_kind(m) is None:
            continue
        trail = [*prefix, str(i)]
        yield trail, m
        for sub, nested in _nested(m):
            yield from _steps(nested, [*trail, *sub])


def _op_keys(op: str | None) -> tuple[str, ...]:
    """`in`, `out` and the arguments the op's signature lists (none for an unknown op;
    an op that takes any keyword, like `optimizer`, still needs + for unlisted ones)."""
    from jobrun.ops.registry import registry

    spec = registry().get(op or "")
    return OP_IO_KEYS + (tuple(a.name for a in spec.args) if spec is not None else ())


def _takes_any_key(op: str | None) -> bool:
    from jobrun.ops.registry import registry

    spec = registry().get(op or "")
    return spec is not None and spec.extra_args


def _some_key(at: _At) -> str:
    known = _op_keys(at.op) if at.kind == "args" else _KNOWN.get(at.kind, ())
    node_keys = [k for k in at.node if k not in OP_IO_KEYS] if isinstance(at.node, dict) else []
    return next(iter([*node_keys, *[k for k in known if k not in OP_IO_KEYS]]), "KEY")


# -- helpers -----------------------------------------------------------------------------


def _then(first: str, second: str) -> str:
    """Two sentences of a hint: `did you mean 'x'? To add ...`."""
    if not second:
        return first
    return f"{first}{'' if first.endswith('?') else '.'} {second[0].upper()}{second[1:]}"


def _close(word: str, choices: list[str], prefix: str) -> str | None:
    """'did you mean 'vars.lr'?' over `choices`, each shown with `prefix`."""
    import difflib  # only for a message: not on the way of every plan

    close = difflib.get_close_matches(word, choices, n=2, cutoff=0.6)
    return "did you mean " + " or ".join(repr(prefix + c) for c in close) + "?" if close else None


def _join_dotted_key(node: dict, parts: list[str], depth: int) -> None:
    """Op names contain dots (`data.synthetic`): where the mapping has a key made of
    several parts of the path, take the longest such key as one part."""
    for end in range(len(parts), depth + 1, -1):
        key = ".".join(parts[depth:end])
        if key in node:
            parts[depth:end] = [key]
            return


def _own_pos(node: Any, default: Pos) -> Pos:
    return node.pos if isinstance(node, PMap | PList) else default


def _pad(positions: list[Pos], n: int, fill: Pos) -> list[Pos]:
    while len(positions) < n:
        positions.append(fill)
    return positions
