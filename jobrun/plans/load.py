"""YAML text -> plain data that remembers where every value came from.

Only plain YAML is accepted: mappings, sequences, strings, ints, floats (infinities
included), booleans and null. Tags, timestamps, merge keys, duplicate keys, NaN and
oversized or alias-expanding input are refused with a message that points at the file,
line and column. The loader knows nothing of plans; :mod:`jobrun.plans.compile` gives the
data its meaning.

Numbers are read as YAML 1.2 (and Python) write them: `1e-4`, `1E5` and `+1.5e3` are
floats, `.inf`/`-.inf` infinities, `0o17` octal, `1_000` a thousand, and `1:30` a string
(YAML 1.1, PyYAML's default, reads `1e-4` as a string and `1:30` as 90). An integer with
a leading zero (`017`: 15 in YAML 1.1, 17 in 1.2) is refused rather than guessed. The
words stay YAML 1.1's: yes/no/on/off are booleans, as they always were in jobrun plans.

The tree is built straight from libyaml's parse events in one loop rather than through
PyYAML's composer: the C composer recurses once per nesting level and crashes the process
on input nested some ten thousand levels deep, and its node graph would be walked a second
time anyway.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)

from jobrun.errors import PlanError, Pos
from jobrun.plans.scalars import NUMBER_START, Bad, kind_of, number, shorten, show
from jobrun.plans.tree import CloneBudgetExceeded, PList, PMap, clone

MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_NODES = 5_000_000  # values in one plan, aliases expanded
MAX_ALIAS_NODES = 200_000  # values created by expanding aliases: stops "billion laughs" fast
MAX_DEPTH = 100

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVERS: dict[Any, list[tuple[str, re.Pattern[str]]]] = yaml.resolver.Resolver.yaml_implicit_resolvers
_constructor = yaml.constructor.SafeConstructor()

_YAML = "tag:yaml.org,2002:"
_STR = _YAML + "str"
_INT = _YAML + "int"
_FLOAT = _YAML + "float"
_BOOL = _YAML + "bool"
_NULL = _YAML + "null"
_SEQ = _YAML + "seq"
_MAP = _YAML + "map"
_TIMESTAMP = _YAML + "timestamp"
# Tags that only say "the default kind": `!` (non-specific) and the core ones.
_MAP_TAGS = (None, "!", _MAP)
_SEQ_TAGS = (None, "!", _SEQ)
_SCALAR_TYPES = {_INT: "an integer", _FLOAT: "a number", _BOOL: "a boolean", _NULL: "null"}

# A plain value with ${var}s in it, as it stands in a line of a flow collection.
_VAR_REF = re.compile(r"(?:\$\{[^{}\[\],]*\}|[^\s{}\[\],])+")
# Characters YAML refuses (C0 controls but tab/newline/CR, DEL, C1 but NEL, surrogates,
# U+FFFE/U+FFFF). Checked up front so that the error has a line and column: libyaml only
# reports a byte offset for them.
_BAD_CHAR = re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")



def _too_deep(pos: Pos) -> PlanError:
    return PlanError(
        f"plan is nested more than {MAX_DEPTH} levels deep", pos,
        "flatten the plan (a loop body can be a list of steps, not a deeper nesting)",
    )


def nesting(value: Any, limit: int = MAX_DEPTH) -> int:
    """How many containers deep `value` is (a scalar is 0), counting no further than
    `limit` + 1: enough to refuse a value that would be nested too deep."""
    if not isinstance(value, list | dict):
        return 0
    if limit <= 0:
        return 1
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((nesting(v, limit - 1) for v in items if isinstance(v, list | dict)), default=0)


def load_file(path: str | Path, *, run_file: bool = False) -> PMap:
    """Read and parse a plan file; every failure is a PlanError (exit code 2).
    ``run_file``: a file jobrun keeps in a run directory (its plan copy), read as one:
    a regular file only, never through a link (a FIFO planted there would block)."""
    p = Path(path)
    try:
        # At most one byte past the limit, whatever the file is (a pipe, /dev/zero): its
        # size on disk says nothing then.
        if run_file:
            from jobrun import safefs

            data = safefs.read_bounded(p, MAX_FILE_BYTES)
        else:
            with open(p, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise PlanError(
                f"plan file is more than the {MAX_FILE_BYTES} bytes allowed",
                Pos(str(path)),
                "split the data out of the plan (load it with data.load)",
            )
    except PlanError:
        raise
    except FileNotFoundError:
        raise PlanError(f"no such plan file: {path}", hint="check the path") from None
    except IsADirectoryError:
        raise PlanError(f"{path} is a directory, not a plan file", hint="give a .yaml file") from None
    except OSError as e:
        raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + 1
        col = len(data[line_start : e.start].decode("utf-8", "replace")) + 1
        raise PlanError(
            f"plan file is not UTF-8 text (byte 0x{data[e.start]:02x} cannot start or continue a character)",
            Pos(str(path), line, col),
            "save the file as UTF-8",
        ) from None
    return load_text(text, str(path))


def load_text(text: str, filename: str = "<plan>") -> PMap:
    """Parse YAML text whose top level must be a mapping."""
    value, pos = _Builder(filename).build(text)
    if value is _EMPTY or value is None:
        raise PlanError("plan file is empty", Pos(filename, 1, 1), "start with `job: NAME`")
    if not isinstance(value, PMap):
        raise PlanError(
            f"a plan must be a mapping of keys (job, epoch, ...), not {kind_of(value)}",
            pos,
            "start the file with `job: NAME`",
        )
    return value


def parse_value(text: str, filename: str) -> Any:
    """Parse one YAML value of any kind (a `--set` value); empty text is null."""
    value, _ = _Builder(filename).build(text)
    return None if value is _EMPTY else value


def mark_pos(file: str, mark: Any) -> Pos:
    """The position of a libyaml mark (0-based) as a Pos (1-based)."""
    return Pos(file, mark.line + 1, mark.column + 1)


_EMPTY = object()  # no document at all
_NOKEY = object()  # the innermost mapping waits for a key
_MISS = object()  # not in the scalar cache yet




class _Builder:
    """Builds PMap/PList trees from parse events, checking each value as it comes."""

    def __init__(self, filename: str):
        self.file = filename
        self.plain: dict[str, Any] = {}  # plain scalar text -> value (or Bad)
        self.alias_budget = [MAX_ALIAS_NODES]

    def build(self, text: str) -> tuple[Any, Pos | None]:
        """(top value or _EMPTY, its position)."""
        if len(text) > MAX_FILE_BYTES:
            raise PlanError("plan text is too large", Pos(self.file))
        bad = _BAD_CHAR.search(text)
        if bad is not None:
            raise self.bad_char(text, bad.start())
        loader = _Loader(text)
        try:
            return self.events(loader)
        except yaml.MarkedYAMLError as e:
            raise self.yaml_error(e, text) from None
        except yaml.YAMLError as e:  # no position (should not happen after the checks above)
            raise PlanError(f"invalid YAML: {e}", Pos(self.file)) from None
        finally:
            loader.dispose()

    def bad_char(self, text: str, index: int) -> PlanError:
        line = text.count("\n", 0, index) + 1
        col = index - (text.rfind("\n", 0, index) + 1) + 1
        ch = text[index]
        what = "a NUL character" if ch == "\x00" else f"the character U+{ord(ch):04X}"
        return PlanError(
            f"plan contains {what}, which YAML does not allow",
            Pos(self.file, line, col),
            "remove it; inside a double-quoted string write it as an escape (\\x01, \\u0001)",
        )

    def yaml_error(self, e: yaml.MarkedYAMLError, text: str) -> PlanError:
        """libyaml's message, placed at the problem, with the likely cause as the hint."""
        mark = e.problem_mark or e.context_mark
        pos = mark_pos(self.file, mark) if mark is not None else Pos(self.file)
        what = e.problem or e.context or "invalid YAML"
        if "maximum nesting depth" in what:  # libyaml's own limit (PyYAML >= 6.0.3), far past ours
            return _too_deep(pos)
        hint = "check indentation, colons and quotes"
        cm = e.context_mark
        line = ""
        if mark is not None:
            lines = text.splitlines()
            line = lines[mark.line] if mark.line < len(lines) else ""
        if mark is not None and "\t" in line[: len(line) - len(line.lstrip())] or (
            "cannot start any token" in what and line[mark.column : mark.column + 1] == "\t"
        ):
            return PlanError(
                "invalid YAML: a tab character; YAML indents with spaces only", pos,
                "replace the tab by spaces",
            )
        kind = None
        if e.context and cm is not None:
            kind = "'['" if "flow sequence" in e.context else "'{'" if "flow mapping" in e.context else None
        if kind and ("expected ','" in what or "stream end" in what):
            what = f"{what} to close the {kind} at line {cm.line + 1}, column {cm.column + 1}"
            hint = "close it, or separate its items with commas"
            if mark is not None and mark.column > 0 and line[mark.column - 1 : mark.column + 1] == "${":
                # In [...] and {...} YAML reads the `{` of an unquoted ${var} as a new mapping.
                start = max(line.rfind(c, 0, mark.column) for c in " ,[{") + 1
                ref = _VAR_REF.match(line, start)
                value = ref.group() if ref and "${" in ref.group() else "${...}"
                hint = f'quote it: "{value}" (a ${{...}} inside [...] or {{...}} must be quoted)'
        elif e.context and "quoted scalar" in e.context and cm is not None:
            return PlanError(
                "invalid YAML: the quoted string that starts here is never closed",
                mark_pos(self.file, cm), "add the closing quote",
            )
        elif "cannot start any token" in what and line[mark.column : mark.column + 1] in ("@", "`", "%"):
            hint = f"{line[mark.column]!r} cannot start a plain value in YAML: quote the value"
        elif "mapping values are not allowed" in what:
            what = "unexpected ':' (a `key: value` where none can start)"
            hint = (
                "indent this line like the keys around it, or quote a value that contains ': '"
            )
        elif e.context and cm is not None and e.problem_mark is not None and cm.line != e.problem_mark.line:
            what = f"{what} ({e.context} at line {cm.line + 1}, column {cm.column + 1})"
        return PlanError(f"invalid YAML: {what}", pos, hint)

    def events(self, loader: Any) -> tuple[Any, Pos | None]:
        # One flat loop over the events, with the innermost open container and whether
        # it is a mapping kept in locals: this is the hot path of loading a big plan.
        get = loader.get_event
        file = self.file
        plain = self.plain
        anchors: dict[str, Any] = {}
        stack: list[Any] = []  # open containers, innermost last
        top: Any = None  # stack[-1]
        in_map = False  # top is a PMap
        key: Any = _NOKEY  # pending key of the innermost mapping
        kpos: Any = None  # and its position
        root: Any = _EMPTY
        root_pos: Pos | None = None
        docs = 0
        nodes = 0
        while True:
            ev = get()
            cls = ev.__class__
            if cls is ScalarEvent:
                mark = ev.start_mark
                pos = Pos(file, mark.line + 1, mark.column + 1)
                if in_map and key is _NOKEY:
                    # A key is taken as written (so `2020-01-01:` or `.nan:` are fine).
                    text = ev.value
                    if ev.tag is None and ev.anchor is None and text != "<<" and text not in top:
                        key = text
                    else:
                        key = self.key(ev, top, pos)
                        if ev.anchor is not None:
                            anchors[ev.anchor] = text
                    kpos = pos
                    continue
                tag = ev.tag
                if tag is None and ev.implicit[0]:
                    value = plain.get(ev.value, _MISS)
                    if value is _MISS:
                        value = plain[ev.value] = self.resolve_plain(ev.value)
                    if value.__class__ is Bad:
                        raise PlanError(value.message, pos, value.hint)
                elif tag is None or tag == "!" or tag == _STR:
                    value = ev.value
                    if "\x00" in value:  # a quoted "\0": no name, path or text holds one
                        raise PlanError("a string holds a NUL character (\\0)", pos,
                                        "remove it: no name, path or text of a plan may hold one")
                else:
                    value = self.tagged(tag, ev.value)
                    if value.__class__ is Bad:
                        raise PlanError(value.message, pos, value.hint)
                if ev.anchor is not None:
                    anchors[ev.anchor] = value
            elif cls is MappingStartEvent or cls is SequenceStartEvent:
                mark = ev.start_mark
                pos = Pos(file, mark.line + 1, mark.column + 1)
                if in_map and key is _NOKEY:
                    raise self.key_error(cls, pos)
                if cls is MappingStartEvent:
                    if ev.tag not in _MAP_TAGS:
                        raise self.tag_error(ev.tag, pos)
                    value = PMap(pos)
                else:
                    if ev.tag not in _SEQ_TAGS:
                        raise self.tag_error(ev.tag, pos)
                    value = PList(pos)
                if len(stack) >= MAX_DEPTH:
                    raise _too_deep(pos)
                if ev.anchor is not None:
                    anchors[ev.anchor] = value
            elif cls is MappingEndEvent or cls is SequenceEndEvent:
                stack.pop()
                top = stack[-1] if stack else None
                in_map = top.__class__ is PMap
                continue
            elif cls is AliasEvent:
                mark = ev.start_mark
                pos = Pos(file, mark.line + 1, mark.column + 1)
                if in_map and key is _NOKEY:
                    raise self.key_error(cls, pos)
                value = self.alias(ev.anchor, anchors, stack, pos)
            elif cls is DocumentStartEvent:
                docs += 1
                if docs > 1:
                    raise PlanError(
                        "a plan file holds one YAML document, but a second one starts here",
                        mark_pos(file, ev.start_mark), "remove the `---` line (and what follows, or merge it)",
                    )
                continue
            elif cls is StreamEndEvent or ev is None:
                break
            else:  # stream start, document end
                continue

            nodes += 1
            if nodes > MAX_NODES:
                raise PlanError(
                    f"plan has more than {MAX_NODES} values", pos,
                    "move data out of the plan (load it with data.load)",
                )
            if in_map:
                top[key] = value
                top.key_pos[key] = kpos
                top.val_pos[key] = pos
                key = _NOKEY
            elif top is not None:
                top.append(value)
                top.item_pos.append(pos)
            else:
                root, root_pos = value, pos
            if cls is MappingStartEvent:
                stack.append(value)
                top, in_map = value, True
            elif cls is SequenceStartEvent:
                stack.append(value)
                top, in_map = value, False
        return root, root_pos

    def key_error(self, cls: Any, pos: Pos) -> PlanError:
        what = "an alias" if cls is AliasEvent else "a list or mapping"
        return PlanError(f"a mapping key must be a plain word, not {what}", pos, "write `name: value`")

    def key(self, ev: Any, top: PMap, pos: Pos) -> str:
        """The text of a scalar key, checked (the loop's fast path takes plain new keys)."""
        if ev.tag not in (None, "!", _STR) and ev.tag not in _SCALAR_TYPES:
            raise self.tag_error(ev.tag, pos)
        # The key's text as written: `on:` stays "on", not True, and `1:` is "1".
        text = ev.value
        if text == "<<" and ev.implicit[0]:
            raise PlanError(
                "YAML merge keys (<<) are not supported", pos, "write the keys out in full"
            )
        if text in top:
            first = top.key_at(text)
            raise PlanError(
                f"duplicate key {show(text)} (first at line {first.line}, column {first.col})",
                pos, "remove one of them",
            )
        return text

    def alias(self, name: str, anchors: dict[str, Any], stack: list[Any], pos: Pos) -> Any:
        if name not in anchors:
            raise PlanError(f"alias *{name} has no anchor &{name} before it", pos, "define the anchor first")
        target = anchors[name]
        if any(c is target for c in stack):
            raise PlanError(
                f"recursive YAML alias *{name}: it refers to a value that contains it", pos,
                "remove the alias cycle",
            )
        try:
            return clone(target, self.alias_budget)
        except CloneBudgetExceeded:
            raise PlanError(
                f"aliases expand to more than {MAX_ALIAS_NODES} values (a 'billion laughs' document?)",
                pos, "write the plan without deeply repeated aliases",
            ) from None

    def resolve_plain(self, text: str) -> Any:
        """The value of an untagged plain scalar: numbers as YAML 1.2, words as YAML 1.1."""
        if text[:1] in NUMBER_START:
            value = number(text)
            if value is not None:
                return value
        tag = next((t for t, regexp in _RESOLVERS.get(text[:1], ()) if regexp.match(text)), None)
        if tag in (_BOOL, _NULL):
            return self.construct(tag, text)
        if tag == _TIMESTAMP:
            return Bad(f"{text!r} reads as a date; plans take no dates", f'quote it: "{text}"')
        # YAML 1.1's other numbers (1:30, 0b_1) and `<<`/`=` as values mean nothing here.
        return text

    def tagged(self, tag: str, text: str) -> Any:
        if tag in _SCALAR_TYPES:
            return self.construct(tag, text)
        if tag == _TIMESTAMP:
            return Bad(f"{_show_tag(tag)} {text!r}: plans take no dates", f'write a string: "{text}"')
        return Bad(*_tag_message(tag))

    def construct(self, tag: str, text: str) -> Any:
        if tag in (_INT, _FLOAT):
            value = number(text.strip())
            if value.__class__ is Bad:
                return value
            if tag == _INT and type(value) is int:
                return value
            if tag == _FLOAT and value is not None:
                return float(value)
        elif tag == _BOOL:
            try:
                return _constructor.construct_yaml_bool(yaml.ScalarNode(tag, text))
            except KeyError:
                pass
        else:
            return None
        return Bad(
            f"{shorten(text)!r} is not {_SCALAR_TYPES[tag]} (tag {_show_tag(tag)})",
            "remove the tag or fix the value",
        )

    def tag_error(self, tag: str, pos: Pos) -> PlanError:
        message, hint = _tag_message(tag)
        return PlanError(message, pos, hint)




def _tag_message(tag: str) -> tuple[str, str]:
    return (
        f"YAML tag {_show_tag(tag)} is not allowed: plans are plain data",
        "remove the tag (plans cannot construct Python objects, sets or binary data)",
    )


def _show_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML) :] if tag.startswith(_YAML) else tag




def to_plain(value: Any) -> Any:
    """Drop positions: PMap/PList -> dict/list (used to store and dump resolved plans)."""
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value
