"""A fast loader for the part of YAML that plans are written in.

Through PyYAML, each libyaml parse event costs about a microsecond, and a plan of
100,000 ops is 1.4 million events. Plans use a small part of YAML: block mappings and
lists laid out by indentation, one-line flow collections (`{in: [a, b], out: c}`), plain
and simply quoted scalars, and comments. This module reads that part line by line; the
flow collections of the whole file are turned into JSON with a few passes of C-speed
string operations and parsed by the json module in one call.

It builds the same tree as the exact loader in :mod:`jobrun.plans.load` (the tests
compare the two on every example, every broken plan and generated input), without
positions: those are worked out when first asked for (see :mod:`jobrun.plans.tree`).
Anything else (anchors, tags, block scalars, multi-line flow collections or plain
scalars, escapes, tabs, CRs, several documents, odd indentation, duplicate keys, values
the loader refuses) makes `parse` return None, and the exact loader reads the text
instead. So this module never decides what a plan means or what an error says; it only
has to know when to step aside.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from jobrun.plans.tree import FastList, FastMap, PList, PMap, Source

# Each line: indentation, a list item's dash, a key (plain or quoted, before ': '), the
# rest. Blank and comment lines match with nothing but spaces or a comment as the rest.
_LINE = re.compile(
    r"""^(\ *+)
    (-(?:\ ++|$))?
    (?:([^\s\-?:,\[\]{}\#&*!|>'"%@`][^\s:\#]*+(?:\ ++[^\s:\#]++)*+|"[^"\\\n]*+"|'[^'\n]*+')\ *+:(?:\ ++|$))?
    (.*)$""",
    re.X | re.M,
)
_DQ = re.compile(r'"([^"\\]*)"(?:\ +\#.*)?\ *\Z', re.S)
_SQ = re.compile(r"'([^']*)'(?:\ +\#.*)?\ *\Z", re.S)

# Flow collections without quotes or comments (nearly all of them) become JSON by
# quoting every word: `{in: [a, 1]}` -> `{"in": ["a", 1]}`. A word is a name-like plain
# scalar; anything else that is not JSON already (`500ms`, `1e5`, `a b`, `-x`, `0x1f`)
# leaves the text invalid, and the collection is read token by token instead.
_WORD = re.compile(r"([A-Za-z_$][A-Za-z0-9_$./-]*)")  # ASCII: others go token by token
# Double-quoted strings without escapes are JSON strings as they are. They may only
# stand where a scalar starts and ends (`["a b", c]`): a quote next to a word
# (`[a"b"]`) sends the collection to the token-by-token path.
_STRING = re.compile(r'("[^"\\\n\x00]*")')
_STRINGS_APART = re.compile(r'(?:[^"]++|(?<=[\[{,:\ ])"[^"\\\n]*+"(?=\ *+[\]},:]))*+\Z')
_LONG_NUMBER = re.compile(r"[0-9]{19}")  # JSON reads any integer; the loader refuses big ones
# YAML 1.1 words that are not strings (after quoting, they are put back as JSON).
_SPECIAL = {
    **dict.fromkeys(("yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"), "true"),
    **dict.fromkeys(("no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"), "false"),
    **dict.fromkeys(("null", "Null", "NULL"), "null"),
}

# The other collections, token by token. Brackets, commas, colons and spaces are not
# tokens: re.split leaves them as they are, and they mean the same in JSON. Any other
# character that no token takes (an anchor's &, a tag's !, a `: ` without a key) is left
# in the text too, where it makes the JSON invalid, so the exact loader reads the file.
# (libyaml refuses a `:` inside a plain scalar of a flow collection when `,?[]{}` follows.)
_PLAIN_CHARS = r"(?:[^\s:,\[\]{}\x00]++|:(?=[^\s,?\[\]{}\x00]))*+"
_PLAIN = (
    r"(?:[^\s\-?:,\[\]{}#&*!|>'\"%@`\x00]|-(?=[^\s,\[\]{}\x00]))"
    + _PLAIN_CHARS + r"(?:\ +(?![\#\s,\[\]{}:\x00])" + _PLAIN_CHARS + r")*+"
)
# After a quoted key, `:` may touch what follows (`"a":[1]`); after a plain one it must
# be followed by a space, or libyaml refuses the text (`{a:[1]}`). A colon that no key
# token takes is made invalid JSON (see by_tokens).
_KEY_END = r"(?:\ *:)?"
_PLAIN_KEY_END = r"(?:\ *:(?=[\s\x00]|\Z))?"
_TOKEN = re.compile(  # one group around the whole token, for re.split
    r'("[^"\\\n\x00]*"' + _KEY_END
    + r"|'[^'\n\x00]*'" + _KEY_END
    + r"|\ +\#[^\n\x00]*"
    + r"|" + _PLAIN + _PLAIN_KEY_END + ")",
    re.X,
)

# JSON arrays become objects with this one key, so that the object hook (the only one
# json has) builds the PList too. Plans hold no control characters, so no plan key
# can be "\x02", nor any plan string "\x01" (which marks each collection, see `flows`).
_OPEN = '{"\\u0002":['
_CLOSE = "]}"

# Text the fast path leaves to the exact loader: tabs, CRs, a byte-order mark, and the
# other characters YAML takes as line breaks.
_NOT_FAST = ("\t", "\r", "\ufeff", "\x85", "\u2028", "\u2029")
_BOOL_JSON = {True: "true", False: "false"}


class _Fallback(Exception):
    """The text is outside the fast path's part of YAML."""


def parse(
    text: str, filename: str, resolve: Callable[[str], Any], exact: Callable[[str, str], Any],
    *, max_depth: int, max_nodes: int, bad: type,
) -> PMap | None:
    """The plan's tree, or None when the exact loader must read `text`.

    `resolve` gives a plain scalar's value (an instance of `bad` when the loader
    refuses it); `exact(text, filename)` parses with positions, on first need. The
    tree's `refs` lists where `${` occurs: (top-level key, container, key, depth).
    """
    if any(c in text for c in _NOT_FAST):
        return None
    try:
        return _Reader(text, filename, resolve, exact, max_depth, max_nodes, bad).read()
    except (_Fallback, ValueError, RecursionError):  # json's errors are ValueErrors
        return None


class _Reader:
    def __init__(
        self, text: str, filename: str, resolve: Callable[[str], Any],
        exact: Callable[[str, str], Any], max_depth: int, max_nodes: int, bad: type,
    ):
        self.src = Source(filename, text, exact)
        self.resolve = resolve
        self.bad = bad
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.values: dict[str, Any] = {}  # plain scalar -> value
        self.flows: list[str] = []  # flow collections, in order
        self.joined = ""  # all of them, NUL-separated, once sort_flows has looked
        self.homes: list[tuple[Any, Any]] = []  # where each goes: (container, key)
        self.refs: list[tuple[str, Any, Any, int]] = []
        self.top: str = ""  # the top-level key being read
        # The lines that hold something (not blank, not only a comment).
        self.rows = [r for r in _LINE.findall(text) if r[1] or r[2] or (r[3] and r[3][0] != "#")]

    def read(self) -> PMap:
        rows = self.rows
        if not rows or rows[0][1] or not rows[0][2]:
            raise _Fallback  # empty, or the top is not a block mapping
        if len(rows) > self.max_nodes:
            raise _Fallback
        root, k = self.mapping(0, len(rows[0][0]), False, 1)
        if k != len(rows):
            raise _Fallback
        if self.flows:
            self.place_flows()
        self.src.attach(root)
        root.refs = self.refs
        return root

    # -- block structure -------------------------------------------------------------
    def mapping(self, k: int, col: int, dashed: bool, depth: int) -> tuple[PMap, int]:
        """The block mapping whose keys sit at column `col`, from row k (which holds its
        first key after a list dash when `dashed`)."""
        if depth >= self.max_depth:
            raise _Fallback
        m = FastMap()
        rows = self.rows
        n = len(rows)
        first = dashed
        while k < n:
            ind, dash, key, rest = rows[k]
            if first:
                first = False
            elif len(ind) != col or dash:
                if len(ind) < col:
                    break
                raise _Fallback
            if not key:
                raise _Fallback
            key = _key_text(key)
            if key in m:
                raise _Fallback
            if depth == 1:
                self.top = key
            if not rest or rest[0] == "#":
                m[key], k = self.nested(k + 1, col, True, depth)
            else:
                m[key] = self.inline(rest, m, key, depth)
                k += 1
        return m, k

    def sequence(self, k: int, col: int, depth: int) -> tuple[PList, int]:
        """The block list whose dashes sit at column `col`, from row k."""
        if depth >= self.max_depth:
            raise _Fallback
        lst = FastList()
        rows = self.rows
        n = len(rows)
        while k < n:
            ind, dash, key, rest = rows[k]
            if len(ind) != col or not dash:
                if len(ind) <= col:
                    break
                raise _Fallback
            if key and (k + 1 == n or len(rows[k + 1][0]) <= col) and rest and rest[0] != "#":
                # `- name: value` alone (most steps of a plan): the mapping in one go.
                item = self.single(key, rest, depth + 1)
                k += 1
            elif key:
                item, k = self.mapping(k, col + len(dash), True, depth + 1)
            elif not rest or rest[0] == "#":
                item, k = self.nested(k + 1, col, False, depth)
            else:
                item = self.inline(rest, lst, len(lst), depth)
                k += 1
            lst.append(item)
        return lst, k

    def single(self, key: str, rest: str, depth: int) -> PMap:
        """The mapping of one key and an inline value, as `mapping` would read it."""
        if depth >= self.max_depth:
            raise _Fallback
        key = _key_text(key)
        m = FastMap()
        m[key] = self.inline(rest, m, key, depth)
        return m

    def nested(self, k: int, col: int, in_map: bool, depth: int) -> tuple[Any, int]:
        """The value of a key or dash that has nothing after it on its line: a block on
        the lines below, indented deeper (or a list at the key's column), or null."""
        rows = self.rows
        if k < len(rows):
            ind, dash, key = rows[k][0], rows[k][1], rows[k][2]
            if len(ind) > col:
                if dash:
                    return self.sequence(k, len(ind), depth + 1)
                if key:
                    return self.mapping(k, len(ind), False, depth + 1)
                raise _Fallback  # a scalar on a line of its own
            if len(ind) == col and dash and in_map:
                return self.sequence(k, col, depth + 1)
        return None, k

    def inline(self, rest: str, up: Any, ukey: Any, depth: int) -> Any:
        """The value written after `key: ` or `- ` on the same line."""
        c = rest[0]
        if c == "{" or c == "[":
            if depth + rest.count("[") + rest.count("{") >= self.max_depth:
                raise _Fallback
            if "${" in rest:
                self.refs.append((self.top, up, ukey, depth + 1))
            self.flows.append(rest)
            self.homes.append((up, ukey))
            return None  # replaced in place_flows
        if c == '"' or c == "'":
            m = (_DQ if c == '"' else _SQ).match(rest)
            if m is None:
                raise _Fallback
            value = m.group(1)
        elif c in "&*!|>%@`?:,]}" or (c == "-" and (len(rest) == 1 or rest[1] == " ")):
            raise _Fallback
        else:
            cut = rest.find(" #")
            text = (rest if cut < 0 else rest[:cut]).rstrip(" ")
            if ": " in text or text[-1] == ":":
                raise _Fallback
            value = self.plain(text)
        if value.__class__ is str and "${" in value:
            self.refs.append((self.top, up, ukey, depth + 1))
        return value

    def plain(self, text: str) -> Any:
        """The value of a plain scalar (each text resolved once); refused ones fall back."""
        value = self.values.get(text, self)
        if value is self:
            value = self.values[text] = self.resolve(text)
        if value.__class__ is self.bad:
            raise _Fallback
        return value

    # -- flow collections ------------------------------------------------------------
    def place_flows(self) -> None:
        """Parse every flow collection at once and put each where it belongs."""
        words, tokens = self.sort_flows()
        values: dict[int, Any] = {}
        if words:
            try:
                values.update(zip(words, self.parse_flows(self.by_words(words)), strict=True))
            except (_Fallback, ValueError):
                tokens = sorted(tokens + words)
        if tokens:
            values.update(zip(tokens, self.parse_flows(self.by_tokens(tokens)), strict=True))
        for i, (up, ukey) in enumerate(self.homes):
            up[ukey] = values[i]

    def sort_flows(self) -> tuple[list[int], list[int]]:
        """The collections `by_words` can take, and the others."""
        flows = self.flows
        every = self.joined = "\x00".join(flows)
        if _by_words_ok(every):  # the usual case: every one of them, at C speed
            return list(range(len(flows))), []
        words, tokens = [], []
        for i, flow in enumerate(flows):
            (words if _by_words_ok(flow) else tokens).append(i)
        return words, tokens

    def by_words(self, which: list[int]) -> str:
        """JSON for collections without single quotes, comments or `:` inside words."""
        text = self.join(which)
        if _LONG_NUMBER.search(text):
            raise _Fallback
        if '"' not in text:
            return _quote_words(text)
        pieces = _STRING.split(text)  # outside strings, a string (JSON already), ...
        pieces[::2] = [_quote_words(p) for p in pieces[::2]]
        return "".join(pieces)

    def by_tokens(self, which: list[int]) -> str:
        """JSON for any collections, each scalar converted on its own (and once)."""
        parts = _TOKEN.split(self.join(which))
        tokens = parts[1::2]
        conv = {t: self.token_json(t) for t in set(tokens)}
        parts[1::2] = map(conv.__getitem__, tokens)
        # Between tokens, a colon belongs to no key: YAML refuses it (`{a:[1]}`), and so
        # must the JSON, which a `#` makes sure of.
        parts[::2] = [p.replace(":", "#").replace("[", _OPEN).replace("]", _CLOSE) for p in parts[::2]]
        return "".join(parts)

    def join(self, which: list[int]) -> str:
        """The collections `which`, NUL-separated (NUL cannot occur in a plan: the
        loader refuses it)."""
        if len(which) == len(self.flows):
            return self.joined
        return "\x00".join([self.flows[i] for i in which])

    def parse_flows(self, joined: str) -> list[Any]:
        """The values of NUL-separated JSON collections. Each is wrapped as
        ["\\u0001", value]: a collection that is not exactly one value on its own
        shows as a wrong count or a wrong item."""
        # Values are separated by commas, so this bounds their number.
        if joined.count(",") + joined.count("{") + len(self.rows) > self.max_nodes:
            raise _Fallback
        doc = '[["\\u0001",' + joined.replace("\x00", '\n],["\\u0001",') + "\n]]"
        items = json.loads(doc, object_pairs_hook=_flow_object)
        out = []
        for item in items:
            if item.__class__ is not list or len(item) != 2 or item[0] != "\x01":
                raise _Fallback
            if not isinstance(item[1], PMap | PList):
                raise _Fallback
            out.append(item[1])
        return out

    def token_json(self, t: str) -> str:
        if t[0] == " ":  # a comment
            return ""
        if t[-1] == ":":  # a key, taken as written
            return _json_str(_key_text(t[:-1].rstrip(" "))) + ":"
        if t[0] == '"':
            return t
        if t[0] == "'":
            return _json_str(t[1:-1])
        value = self.plain(t)
        if value.__class__ is str:
            return _json_str(value)
        if value is None:
            return "null"
        if value.__class__ is bool:
            return _BOOL_JSON[value]
        if value.__class__ is int:
            return str(value)
        if value.__class__ is float:
            return repr(value)  # finite (the loader refuses others); repr round-trips
        raise _Fallback


def _key_text(key: str) -> str:
    """A key as written, without its quotes; a merge key (`<<`) falls back."""
    if key[0] == '"' or key[0] == "'":
        return key[1:-1]
    if key == "<<":
        raise _Fallback
    return key


def _flow_object(pairs: list[tuple[str, Any]]) -> PMap | PList:
    """json's hook for each object: a mapping, or the list of an array (see _OPEN)."""
    if pairs and pairs[0][0] == "\x02":
        return FastList(pairs[0][1])
    m = FastMap(pairs)
    if len(m) != len(pairs):
        raise _Fallback  # a duplicate key
    return m


def _by_words_ok(flow: str) -> bool:
    return (
        flow.isascii() and "'" not in flow and "#" not in flow and flow.count(":") == flow.count(": ")
        and ('"' not in flow or _STRINGS_APART.match(flow) is not None)
    )


def _quote_words(text: str) -> str:
    """Flow text without strings, as JSON (see _WORD)."""
    parts = _WORD.split(text)
    quoted = '"'.join(parts)  # parts alternate: between words, a word, ...
    for word in _SPECIAL.keys() & set(parts[1::2]):
        quoted = quoted.replace(f'"{word}"', _SPECIAL[word])
    return quoted.replace("[", _OPEN).replace("]", _CLOSE)


def _json_str(text: str) -> str:
    # Plans hold no control characters (the loader refuses them), so only quotes and
    # backslashes need escapes, and most strings need none.
    if '"' in text or "\\" in text:
        return json.dumps(text)
    return '"' + text + '"'
