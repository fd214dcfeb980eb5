"""The containers a loaded plan is made of: a dict and a list that know where each of
their values was written.

The loader (:mod:`jobrun.plans.load`) builds them with the exact position of every key,
value and item; `--set` adds positions that name itself (`Pos("--set a.b=1")`).
"""

from __future__ import annotations

from typing import Any

from jobrun.errors import Pos


class PMap(dict):
    """A mapping with the position of itself (`pos`), of each key (`key_pos`) and of each
    value (`val_pos`). Whoever adds a key adds its positions too."""

    __slots__ = ("pos", "key_pos", "val_pos")

    def __init__(self, pos: Pos, key_pos: dict[str, Pos] | None = None, val_pos: dict[str, Pos] | None = None):
        self.pos = pos  # (dict.__new__ made the dict: dict.__init__ would add nothing)
        self.key_pos: dict[str, Pos] = {} if key_pos is None else key_pos
        self.val_pos: dict[str, Pos] = {} if val_pos is None else val_pos

    def at(self, key: str) -> Pos:
        """Position of the value under `key` (or of the mapping when it is absent)."""
        return self.val_pos.get(key, self.pos)

    def key_at(self, key: str) -> Pos:
        """Position of `key` itself (or of the mapping when it is absent)."""
        return self.key_pos.get(key, self.pos)


class PList(list):
    """A list with the position of itself (`pos`) and of each item (`item_pos`)."""

    __slots__ = ("pos", "item_pos")

    def __init__(self, pos: Pos, item_pos: list[Pos] | None = None):
        self.pos = pos
        self.item_pos: list[Pos] = [] if item_pos is None else item_pos

    def at(self, i: int) -> Pos:
        """Position of item `i` (or of the list when there is no such item)."""
        return self.item_pos[i] if 0 <= i < len(self.item_pos) else self.pos


class CloneBudgetExceeded(Exception):
    """Raised by `clone` when its budget runs out (callers turn it into a PlanError)."""


def clone(value: Any, budget: list[int] | None = None) -> Any:
    """A copy of a loaded value: new containers (positions kept), shared scalars.

    `budget` is a one-item list counting down the containers and items it may still
    create; CloneBudgetExceeded is raised when it runs out, and the caller reports it
    with the position that asked for the copy.
    """
    if budget is not None:
        budget[0] -= len(value) + 1 if isinstance(value, list | dict) else 1
        if budget[0] < 0:
            raise CloneBudgetExceeded
    if isinstance(value, dict):
        m = PMap(value.pos, dict(value.key_pos), dict(value.val_pos)) if isinstance(value, PMap) else {}
        for k, v in value.items():
            m[k] = clone(v, budget) if isinstance(v, list | dict) else v
        return m
    if isinstance(value, list):
        lst = PList(value.pos, list(value.item_pos)) if isinstance(value, PList) else []
        lst.extend([clone(v, budget) if isinstance(v, list | dict) else v for v in value])
        return lst
    return value
