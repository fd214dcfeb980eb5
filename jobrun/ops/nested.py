"""Blobs named inside `build`'s nested targets: `{target: ..., in: [vocab_size], ...}`.

A nested mapping with a `target` may take blobs as its leading positional arguments with
`in: [a, b]`, as an op call does, or as keyword arguments with `in: {vocab_size: vocab}`
(argument name: blob name; for keyword-only constructors such as Hugging Face configs). The compiler adds the names to the op call's inputs, after the
op's own (so that `analyze`, checkpoints and `print` see the reads); `build` takes them
back off the end of its inputs, in the order :func:`nested_inputs` walks: a mapping's own
`in` first, then its `args`, then its other keys in the order written. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

NESTING_OPS = ("build",)  # the ops whose nested targets may name blobs


def nested_inputs(args: Any, kwargs: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    """(name, container, key) of every blob a nested target names with `in`, in the
    order `build` consumes them: `args` first, then the other keyword arguments."""
    found: list[tuple[Any, Any, Any]] = []
    _walk(args, found)
    for key, value in kwargs.items():
        if key not in ("target", "args"):
            _walk(value, found)
    return found


def _walk(value: Any, found: list[tuple[Any, Any, Any]]) -> None:
    if isinstance(value, dict):
        if "target" in value:
            names = value.get("in")
            if isinstance(names, list):
                found.extend((name, names, i) for i, name in enumerate(names))
            elif isinstance(names, dict):  # keyword arguments: {vocab_size: vocab}
                found.extend((name, names, key) for key, name in names.items())
            elif names is not None:
                found.append((names, value, "in"))
            _walk(value.get("args"), found)
            for key, v in value.items():
                if key not in ("target", "args", "in"):
                    _walk(v, found)
        else:
            for v in value.values():
                _walk(v, found)
    elif isinstance(value, list | tuple):
        for v in value:
            _walk(v, found)


def split(inputs: tuple[Any, ...], args: Any, kwargs: dict[str, Any]) -> tuple[tuple, Iterator[Any]]:
    """`build`'s own inputs, and an iterator over the values of the nested ones."""
    n = len(nested_inputs(args, kwargs))
    if not n:
        return inputs, iter(())
    return inputs[:-n], iter(inputs[-n:])
