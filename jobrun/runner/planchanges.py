"""What an override changes in a run's plan, as `resume` says it and run.json records it:
one `key: old -> new` line a change, and whether the changes reach what training computes.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def plan_changes(before: Any, after: Any, resolved_before: Any, resolved_after: Any) -> list[str]:
    """`key: old -> new`: the vars as the overrides changed them, then every other key
    with its values after substitution (`max_epochs: 4 -> 6`, not `"${epochs}" -> 6`),
    so a var shows where it is used and a change that uses no var shows its value."""
    var = lambda tree: {"vars": tree.get("vars", _NONE)} if isinstance(tree, dict) else {}  # noqa: E731
    rest = lambda tree: {k: v for k, v in tree.items() if k != "vars"} if isinstance(tree, dict) else tree  # noqa: E731
    return _differences(var(before), var(after)) + _differences(rest(resolved_before), rest(resolved_after))


def _differences(before: Any, after: Any, at: str = "") -> list[str]:
    """`key: old -> new` for every leaf that an override changed, added or removed."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in [*before, *(k for k in after if k not in before)]:
            path = f"{at}.{key}" if at else str(key)
            out += _differences(before.get(key, _NONE), after.get(key, _NONE), path)
        return out
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in _differences(b, a, f"{at}.{i}")]
    if before == after and type(before) is type(after):
        return []
    show = lambda v: "(not set)" if v is _NONE else json.dumps(v)  # noqa: E731
    return [f"{at}: {show(before)} -> {show(after)}"]


_NONE = object()


# Keys a resume may change and still give the result of an uninterrupted run with them
# (raised: they only say when to stop; early_stop's count is in the checkpoint).
_EXTENDING = ("max_epochs", "max_steps", "early_stop.patience")


def beyond_extending(changes: list[str]) -> bool:
    """Whether a change reaches past max_epochs and max_steps into what training computes.
    A var's own line does not count (the keys it changed are listed after it with their
    new values), nor do the download and exit groups, which run after the last epoch."""
    return any(not c.startswith((*(f"{k}:" for k in _EXTENDING), "vars.", "download.", "exit."))
               for c in changes)


def restored(changes: list[str], tree: Any, held: Collection[str]) -> list[tuple[str, list[str]]]:
    """The changes to an argument of an `init` op all of whose outputs a checkpoint holds
    (an optimizer's lr): init builds them with the new value, then the restore puts back
    their saved state, so the change does nothing. (change, the outputs) each."""
    found = []
    for change in changes:
        path = change.split(":", 1)[0].split(".")
        if path[0] != "init" or len(path) < 3:
            continue
        node: Any = tree
        for part in path[:-2]:  # down to the op's mapping ({optimizer: {...}})
            node = _child(node, part)
        args = _child(node, path[-2])
        outs = args.get("out") if isinstance(args, dict) else None
        outs = [outs] if isinstance(outs, str) else outs
        if path[-1] != "out" and isinstance(outs, list) and outs and all(o in held for o in outs):
            found.append((change, outs))
    return found


def _child(node: Any, key: str) -> Any:
    if isinstance(node, dict):
        return node.get(key)
    if isinstance(node, list) and key.isdigit() and int(key) < len(node):
        return node[int(key)]
    return None
