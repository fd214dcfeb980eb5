"""The containers a loaded plan is made of: mappings and lists that know where each of
their values was written.

A position costs more to build than the value it describes, and a plan that loads and
compiles cleanly never shows one, so positions are worked out on first use. A container
holds one of three kinds of position data:

* explicit: `PMap(pos)` / `PList(pos)` with `Pos` objects (values made by `--set`);
* marks: libyaml's marks, from the exact loader in :mod:`jobrun.plans.load`;
* nothing but its place in the tree (`_up`, `_ukey`), from the fast loader in
  :mod:`jobrun.plans.fastyaml`. Asking such a container for a position gives a
  :class:`LazyPos`; the first one resolved has the exact loader parse the file once
  (`Source.tree`), and each position is then read from the container at the same path
  in that tree. Both loaders build the same tree from the same text (the tests check
  it), so the positions are the exact loader's.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from jobrun.errors import Pos

_SELF, _KEY, _VAL = 0, 1, 2  # what a LazyPos stands for: a container, a key, a value
# Positions may be asked for from several threads (a report's error while the task runs).
_RESOLVING = threading.RLock()


def mark_pos(file: str, mark: Any) -> Pos:
    return Pos(file, mark.line + 1, mark.column + 1)


class _Unlinked:
    """The `_src` of a fast container that `Source.link` has not reached yet."""

    name = "<plan>"


_UNLINKED = _Unlinked()
_SOURCES: weakref.WeakSet[Source] = weakref.WeakSet()  # of the fast trees alive


class Source:
    """The text a fast-loaded tree came from, and its exact parse once someone needs a
    position.

    Nothing here makes a reference cycle, so that a plan's objects are freed as soon as
    the plan is dropped, without the cyclic collector (which the loader keeps away from
    big plans, see `load.no_gc`): the root holds its Source, the Source holds the root
    only weakly, and containers find their Source when first linked.
    """

    __slots__ = ("name", "text", "_build", "_tree", "_failed", "_root", "_linked", "__weakref__")

    def __init__(self, name: str, text: str, build: Callable[[str, str], Any]):
        self.name = name
        self.text = text
        self._build = build  # (text, name) -> the exactly positioned tree
        self._tree: Any = None
        self._failed = False
        self._root: Any = None
        self._linked = False

    def attach(self, root: PMap) -> None:
        root._src = self
        self._root = weakref.ref(root)
        _SOURCES.add(self)

    @property
    def root(self) -> Any:
        return self._root() if self._root is not None else None

    def tree(self) -> Any:
        with _RESOLVING:
            if self._tree is None and not self._failed:
                try:
                    self._tree = self._build(self.text, self.name)
                except Exception:  # noqa: BLE001 - a position is never worth a crash
                    self._failed = True  # (cannot happen: the fast loader accepted the text)
            return self._tree

    def link(self) -> None:
        """Give each fast container its Source, its parent and its key there (once, when
        the first position is asked for: loading does not spend the time)."""
        with _RESOLVING:
            root = self.root
            if not self._linked and root is not None:
                self._linked = True
                stack = [root]
                while stack:
                    node = stack.pop()
                    for key, value in node.items() if isinstance(node, dict) else enumerate(node):
                        if isinstance(value, _FAST) and value._src is _UNLINKED and value._origin is None:
                            # A weak link: a strong one would make a cycle with the parent.
                            value._src, value._up, value._ukey = self, weakref.ref(node), key
                            stack.append(value)


def _link_all() -> None:
    for src in list(_SOURCES):
        src.link()


class LazyPos(Pos):
    """A position worked out on first use (see the module docstring)."""

    __slots__ = ("_owner", "_name", "_kind", "_real")

    def __init__(self, owner: Any, name: Any, kind: int = _VAL):
        # `_real` stays unset until resolved: one store less, on a hot path.
        self._owner = owner
        self._name = name
        self._kind = kind

    def _get(self) -> Pos:
        try:
            return self._real
        except AttributeError:
            real = self._real = self._owner._spot(self._name, self._kind)
            self._owner = None  # let the tree go
            return real

    @property  # type: ignore[override]
    def file(self) -> str:
        return self._get().file

    @property  # type: ignore[override]
    def line(self) -> int:
        return self._get().line

    @property  # type: ignore[override]
    def col(self) -> int:
        return self._get().col


class _Located:
    """What loaded containers share: `pos`, and finding their twin in the exact tree."""

    __slots__ = ()

    @property
    def pos(self) -> Pos:
        if self._pos is None:
            if self._src is not None:
                return LazyPos(self, None, _SELF)  # not kept: it would make a cycle
            self._pos = mark_pos(self._file, self._mark)
        return self._pos

    @pos.setter
    def pos(self, value: Pos) -> None:
        self._pos = value

    def _twin(self) -> Any:
        """The container at the same path in the exactly positioned tree (or None)."""
        if self._origin is not None:  # a copy (an alias, a var): where the original is
            return self._origin._twin()
        if self._src is _UNLINKED:
            _link_all()
        src = self._src
        if src is _UNLINKED:
            return None  # no longer in a tree (replaced by --set)
        src.link()
        path = []
        node: Any = self
        while node is not None and node._up is not None:
            path.append(node._ukey)
            node = node._up()
        if node is None or node is not src.root:
            return None
        twin = src.tree()
        for key in reversed(path):
            try:
                twin = twin[key]
            except (KeyError, IndexError, TypeError):
                return None
        return twin if isinstance(twin, dict) == isinstance(self, dict) and isinstance(twin, _Located) else None

    def _spot(self, name: Any, kind: int) -> Pos:
        twin = self._twin()
        if twin is None:
            return Pos(self._src.name)
        if kind == _SELF:
            return twin.pos
        if kind == _KEY:
            return twin.key_at(name)
        return twin.at(name)


class PMap(_Located, dict):
    """A mapping with the position of itself, of each key and of each value.

    `pos`, `key_pos` and `val_pos` read like plain attributes and are computed on first
    use. `at(key)` gives a value's position without building the whole `val_pos` dict.
    """

    __slots__ = (
        "_file", "_mark", "_pos", "_kmarks", "_vmarks", "_key_pos", "_val_pos",
        "_src", "_up", "_ukey", "_origin", "refs",
    )

    def __init__(self, pos: Pos):
        super().__init__()
        self._pos: Pos | None = pos
        self._file = pos.file
        self._mark: Any = None
        self._kmarks: dict[str, Any] | None = None
        self._vmarks: dict[str, Any] | None = None
        self._key_pos: dict[str, Pos] | None = {}
        self._val_pos: dict[str, Pos] | None = {}
        self._src: Source | None = None
        self._up: Any = None
        self._ukey: Any = None
        self._origin: Any = None

    @classmethod
    def _loaded(cls, file: str, mark: Any) -> PMap:
        # dict.__new__ skips __init__: the loader fills the slots itself, for speed.
        m = dict.__new__(cls)
        m._file = file
        m._mark = mark
        m._pos = None
        m._kmarks = {}
        m._vmarks = {}
        m._key_pos = None
        m._val_pos = None
        m._src = None
        m._up = None
        m._ukey = None
        m._origin = None
        return m

    @property
    def key_pos(self) -> dict[str, Pos]:
        """Position of each key (a dict you may update)."""
        if self._key_pos is None:
            self._key_pos = self._all_pos(_KEY, self._kmarks)
        return self._key_pos

    @key_pos.setter
    def key_pos(self, value: dict[str, Pos]) -> None:
        self._key_pos = value

    @property
    def val_pos(self) -> dict[str, Pos]:
        """Position of each value (a dict you may update)."""
        if self._val_pos is None:
            self._val_pos = self._all_pos(_VAL, self._vmarks)
        return self._val_pos

    @val_pos.setter
    def val_pos(self, value: dict[str, Pos]) -> None:
        self._val_pos = value

    def at(self, key: str) -> Pos:
        """Position of the value under `key` (or of the mapping when it is absent)."""
        return self._pos_of(key, _VAL, self._val_pos, self._vmarks)

    def key_at(self, key: str) -> Pos:
        """Position of `key` itself (or of the mapping when it is absent)."""
        return self._pos_of(key, _KEY, self._key_pos, self._kmarks)

    def _all_pos(self, kind: int, marks: dict[str, Any] | None) -> dict[str, Pos]:
        if self._src is not None:
            return {k: LazyPos(self, k, kind) for k in self}
        f = self._file
        return {k: mark_pos(f, m) for k, m in (marks or {}).items()}

    def _pos_of(self, key: str, kind: int, known: dict[str, Pos] | None, marks: dict[str, Any] | None) -> Pos:
        # Positions already made (or given by --set), else lazy ones, else from marks.
        if known is not None:
            p = known.get(key)
        elif self._src is not None:
            p = LazyPos(self, key, kind) if key in self else None
        else:
            mark = marks.get(key) if marks else None
            p = mark_pos(self._file, mark) if mark is not None else None
        return p if p is not None else self.pos


class PList(_Located, list):
    """A list with the position of itself and of each item."""

    __slots__ = ("_file", "_mark", "_pos", "_marks", "_item_pos", "_src", "_up", "_ukey", "_origin")

    def __init__(self, pos: Pos):
        super().__init__()
        self._pos: Pos | None = pos
        self._file = pos.file
        self._mark: Any = None
        self._marks: list[Any] | None = None
        self._item_pos: list[Pos] | None = []
        self._src: Source | None = None
        self._up: Any = None
        self._ukey: Any = None
        self._origin: Any = None

    @classmethod
    def _loaded(cls, file: str, mark: Any) -> PList:
        lst = list.__new__(cls)
        lst._file = file
        lst._mark = mark
        lst._pos = None
        lst._marks = []
        lst._item_pos = None
        lst._src = None
        lst._up = None
        lst._ukey = None
        lst._origin = None
        return lst

    @property
    def item_pos(self) -> list[Pos]:
        """Position of each item (a list you may update)."""
        if self._item_pos is None:
            if self._src is not None:
                self._item_pos = [LazyPos(self, i, _VAL) for i in range(len(self))]
            else:
                f = self._file
                self._item_pos = [mark_pos(f, m) for m in self._marks or ()]
        return self._item_pos

    @item_pos.setter
    def item_pos(self, value: list[Pos]) -> None:
        self._item_pos = value

    def at(self, i: int) -> Pos:
        if self._item_pos is not None:
            if 0 <= i < len(self._item_pos):
                return self._item_pos[i]
        elif self._src is not None:
            if 0 <= i < len(self):
                return LazyPos(self, i, _VAL)
        elif self._marks and 0 <= i < len(self._marks):
            return mark_pos(self._file, self._marks[i])
        return self.pos


# Containers the fast loader makes at C speed (json builds them from pairs): the class
# carries what the exact loader keeps per container, so no slot needs filling in. They
# do have a __dict__, for what `Source.link` and `--set` add later.
_FAST_DEFAULTS = {
    "_src": _UNLINKED, "_file": "<plan>", "_mark": None, "_pos": None, "_up": None,
    "_ukey": None, "_origin": None,
}


class FastMap(PMap):
    __init__ = dict.__init__  # type: ignore[assignment]


class FastList(PList):
    __init__ = list.__init__  # type: ignore[assignment]


for _name, _value in {**_FAST_DEFAULTS, "_kmarks": None, "_vmarks": None, "_key_pos": None, "_val_pos": None}.items():
    setattr(FastMap, _name, _value)
for _name, _value in {**_FAST_DEFAULTS, "_marks": None, "_item_pos": None}.items():
    setattr(FastList, _name, _value)
_FAST = (FastMap, FastList)


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
    if isinstance(value, PMap):
        m = dict.__new__(PMap)
        _copy_origin(m, value)
        # Marks never change once loaded, so copies share them; materialized position
        # dicts may be edited (`--set`), so copies get their own.
        m._kmarks, m._vmarks = value._kmarks, value._vmarks
        m._key_pos = None if value._key_pos is None else dict(value._key_pos)
        m._val_pos = None if value._val_pos is None else dict(value._val_pos)
        for k, v in value.items():
            dict.__setitem__(m, k, clone(v, budget) if isinstance(v, list | dict) else v)
        return m
    if isinstance(value, PList):
        lst = list.__new__(PList)
        _copy_origin(lst, value)
        lst._marks = value._marks
        lst._item_pos = None if value._item_pos is None else list(value._item_pos)
        list.extend(lst, [clone(v, budget) if isinstance(v, list | dict) else v for v in value])
        return lst
    if isinstance(value, dict):
        return {k: clone(v, budget) for k, v in value.items()}
    if isinstance(value, list):
        return [clone(v, budget) for v in value]
    return value


def _copy_origin(new: Any, old: Any) -> None:
    # A copy's positions are those of the original: the same marks, or (fast-loaded)
    # the original's place in the exactly positioned tree.
    new._file, new._mark, new._pos = old._file, old._mark, old._pos
    new._src, new._up, new._ukey = old._src, None, None
    new._origin = (old if old._origin is None else old._origin) if old._src is not None else None
