"""Schemas of the files jobrun reads back: run.json, metrics.jsonl lines, checkpoint
manifests and their meta, module flags and shard facts.

Each of these files is data a user (or a damaged disk) may have changed, so each is parsed
once, by one function per file, that checks every field against a schema (types, number
ranges, string and list sizes, nesting depth) and raises one message that names the file
and the field. One generic checker (:func:`check`) serves every schema; the schemas are
data (:class:`Obj`, :class:`Int`, ...).

Never imports torch or numpy: ``jobrun ckpt list``, ``resume`` and ``plot`` read these.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# JSON nested deeper than this is no jobrun record (run.json's deepest field is 4 levels).
MAX_DEPTH = 24
# Integers jobrun writes fit in 64 bits; a bigger one would overflow float() or a tensor.
MAX_INT = (1 << 63) - 1
MAX_ITEMS = 1 << 16


class Invalid(ValueError):
    """A value that does not fit its schema: ``where`` is the field's path (`a.b[3]`)."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where or 'the top level'}: {what}")
        self.where = where
        self.what = what


def _join(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class Spec:
    """What a JSON value must be. ``check`` returns the value (maybe normalised)."""

    def check(self, v: Any, where: str, depth: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Spec):
    lo: int = -MAX_INT
    hi: int = MAX_INT

    def check(self, v: Any, where: str, depth: int) -> int:
        if type(v) is not int:
            raise Invalid(where, f"an integer expected, not {_show(v)}")
        if not self.lo <= v <= self.hi:
            raise Invalid(where, f"{_show(v)} is out of range ({self.lo} to {self.hi})")
        return v


@dataclass(frozen=True)
class Num(Spec):
    """A finite number (an integer is one too), within [lo, hi]."""

    lo: float = -1e300
    hi: float = 1e300
    finite: bool = True  # False: NaN and the infinities too (a logged loss may be NaN)

    def check(self, v: Any, where: str, depth: int) -> float | int:
        if type(v) not in (int, float):
            raise Invalid(where, f"a number expected, not {_show(v)}")
        if type(v) is int and abs(v) > MAX_INT:
            raise Invalid(where, f"{_show(v)} is out of range")
        if not self.finite and not math.isfinite(v):
            return v
        if not (math.isfinite(v) and self.lo <= v <= self.hi):
            raise Invalid(where, f"{_show(v)} is out of range ({self.lo:g} to {self.hi:g})")
        return v


@dataclass(frozen=True)
class Str(Spec):
    max_len: int = 4096
    pattern: str | None = None

    def check(self, v: Any, where: str, depth: int) -> str:
        if not isinstance(v, str):
            raise Invalid(where, f"a string expected, not {_show(v)}")
        if len(v) > self.max_len:
            raise Invalid(where, f"a string of {len(v)} characters (at most {self.max_len})")
        if self.pattern is not None and not re.fullmatch(self.pattern, v):
            raise Invalid(where, f"{_show(v)} is not a valid value")
        return v


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, v: Any, where: str, depth: int) -> bool:
        if type(v) is not bool:
            raise Invalid(where, f"true or false expected, not {_show(v)}")
        return v


@dataclass(frozen=True)
class OneOf(Spec):
    choices: tuple[Any, ...]

    def check(self, v: Any, where: str, depth: int) -> Any:
        if not any(type(v) is type(c) and v == c for c in self.choices):
            raise Invalid(where, f"{_show(v)} is not one of {', '.join(map(repr, self.choices))}")
        return v


@dataclass(frozen=True)
class Opt(Spec):
    """``spec`` or null."""

    spec: Spec

    def check(self, v: Any, where: str, depth: int) -> Any:
        return None if v is None else self.spec.check(v, where, depth)


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    max_len: int = MAX_ITEMS
    min_len: int = 0

    def check(self, v: Any, where: str, depth: int) -> list[Any]:
        if not isinstance(v, list):
            raise Invalid(where, f"a list expected, not {_show(v)}")
        if not self.min_len <= len(v) <= self.max_len:
            raise Invalid(where, f"a list of {len(v)} items ({self.min_len} to {self.max_len} expected)")
        _deeper(where, depth)
        return [self.item.check(x, _join(where, i), depth + 1) for i, x in enumerate(v)]


@dataclass(frozen=True)
class MapOf(Spec):
    """An object with any keys (strings of at most ``key_len``), every value a ``value``."""

    value: Spec
    max_len: int = MAX_ITEMS
    key_len: int = 256

    def check(self, v: Any, where: str, depth: int) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise Invalid(where, f"an object expected, not {_show(v)}")
        if len(v) > self.max_len:
            raise Invalid(where, f"an object of {len(v)} keys (at most {self.max_len})")
        _deeper(where, depth)
        out = {}
        for k, x in v.items():
            if len(k) > self.key_len:
                raise Invalid(where, f"a key of {len(k)} characters (at most {self.key_len})")
            out[k] = self.value.check(x, _join(where, k), depth + 1)
        return out


@dataclass(frozen=True)
class Obj(Spec):
    """An object with known fields; ``required`` must be present. Unknown fields (a
    newer jobrun's) are kept when ``extra`` says what they may be, refused otherwise."""

    fields: Mapping[str, Spec]
    required: frozenset[str] = frozenset()
    extra: Spec | None = None

    def check(self, v: Any, where: str, depth: int) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise Invalid(where, f"an object expected, not {_show(v)}")
        _deeper(where, depth)
        for name in sorted(self.required - v.keys()):
            raise Invalid(_join(where, name), "missing")
        out = {}
        for k, x in v.items():
            spec = self.fields.get(k, self.extra)
            if spec is None:
                raise Invalid(_join(where, k), "unknown field")
            if len(k) > 256:
                raise Invalid(where, f"a key of {len(k)} characters (at most 256)")
            out[k] = spec.check(x, _join(where, k), depth + 1)
        return out


@dataclass(frozen=True)
class AnyJSON(Spec):
    """Any JSON value, bounded: finite numbers (``finite``), 64-bit integers, sized
    strings and lists."""

    finite: bool = True
    size: int = MAX_ITEMS  # the most characters of a string, items of a list or object

    def check(self, v: Any, where: str, depth: int) -> Any:
        if v is None or type(v) is bool:
            return v
        if type(v) in (int, float):
            return Num(finite=self.finite).check(v, where, depth)
        if isinstance(v, str):
            return Str(self.size).check(v, where, depth)
        if isinstance(v, list):
            return ListOf(self, self.size).check(v, where, depth)
        if isinstance(v, dict):
            return MapOf(self, self.size, key_len=self.size).check(v, where, depth)
        raise Invalid(where, f"unexpected {type(v).__name__}")


ANY = AnyJSON()
# What a `log` step wrote (a logged list or text may be long; the file's size bounds it).
ANY_NUMBER = AnyJSON(finite=False, size=1 << 30)


def _deeper(where: str, depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise Invalid(where, f"nested more than {MAX_DEPTH} levels deep")


class Malformed(ValueError):
    """JSON text that no write of jobrun's, even one cut short, makes: nesting that
    exhausts the stack, integers of thousands of digits, NaN where none is written."""


def _no_constant(name: str) -> Any:
    raise Malformed(f"{name} is not a number JSON allows")


def _int(text: str) -> int:
    # Generous: a numpy generator's state holds 128-bit integers (39 digits).
    if len(text.lstrip("-")) > 400:
        raise Malformed(f"an integer of {len(text)} digits")
    return int(text)


def parse_json(raw: bytes | str, nonfinite: bool = False) -> Any:
    """JSON text as Python values; ValueError (with why) for what is not JSON, Malformed
    for what is not strict JSON: NaN and Infinity (unless ``nonfinite``), integers of
    hundreds of digits, nesting that exhausts the stack."""
    try:
        if nonfinite:
            return json.loads(raw, parse_int=_int)
        return json.loads(raw, parse_constant=_no_constant, parse_int=_int)
    except RecursionError:
        raise Malformed(f"nested more than {MAX_DEPTH} levels deep") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason})") from None


def check(v: Any, spec: Spec) -> Any:
    """``v`` checked against ``spec`` (Invalid otherwise)."""
    return spec.check(v, "", 0)


# ------------------------------------------------------------------------------- run.json

_COUNT = Int(0, 1 << 20)
_SECONDS = Num(0, 4.1e9)  # a time since 1970, before 2100
_TEXT = Str(1 << 20)  # run.json's own bound (a bigger file is refused unread)
_SETS = ListOf(_TEXT, 4096)
RUN_INFO = Obj(
    {
        # running, finished, failed, interrupted (a newer jobrun may say more)
        "job": Str(256), "status": Str(32, r"[a-z_]+"),
        "source": Str(), "plan_dir": Str(), "plan_sha256": Str(64, r"[0-9a-f]{64}"),
        "sets": _SETS, "replicas": Int(1, 1 << 20), "device": Str(64), "started": _SECONDS,
        "ended": _SECONDS, "last_epoch": Opt(_COUNT), "resumed_from": Opt(_COUNT),
        "max_restarts": Opt(_COUNT), "hosts": Int(1, 1 << 20), "host_copy_of": Str(256),
        "launch_token": Str(256), "error": Opt(_TEXT), "error_at": Opt(Str()),
        "jobrun": Str(64), "note": Str(),
        "changes": ListOf(Obj({"from_epoch": _COUNT, "sets": _SETS, "changed": _SETS}), 4096),
        "replica_changes": ListOf(Obj({"from_epoch": _COUNT, "from": Int(1, 1 << 20),
                                       "to": Int(1, 1 << 20)}), 4096),
        "restarts": ListOf(MapOf(ANY, 64), 4096),
    },
    required=frozenset({"job"}),
    extra=ANY,  # a newer jobrun's facts: kept as they are
)


@dataclass(frozen=True)
class RunInfo:
    """run.json, checked: each field of RUN_INFO (None when run.json lacks it), and
    ``record``, every field as read (to write it back, updated)."""

    record: dict[str, Any] = field(repr=False)
    job: str = ""
    status: str | None = None
    source: str | None = None
    plan_dir: str | None = None
    plan_sha256: str | None = None
    sets: list[str] | None = None
    replicas: int | None = None
    device: str | None = None
    started: float | None = None
    ended: float | None = None
    last_epoch: int | None = None
    resumed_from: int | None = None
    max_restarts: int | None = None
    hosts: int | None = None
    host_copy_of: str | None = None
    launch_token: str | None = None
    error: str | None = None
    error_at: str | None = None
    jobrun: str | None = None
    note: str | None = None
    changes: list[dict[str, Any]] | None = None
    replica_changes: list[dict[str, Any]] | None = None
    restarts: list[dict[str, Any]] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.record


def run_info(raw: bytes, path: str, error: Callable[[str], Exception]) -> RunInfo:
    """run.json's bytes as a RunInfo; ``error(message)`` is raised when they are not one."""
    try:
        data = parse_json(raw)
    except ValueError as e:
        raise error(f"{path} is damaged: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("job"), str):
        raise error(f"{path} is not a jobrun run record")
    try:
        record = check(data, RUN_INFO)
    except Invalid as e:
        raise error(f"{path} is damaged: field {e}") from None
    return RunInfo(record, **{k: record[k] for k in RUN_INFO.fields if k in record})


# -------------------------------------------------------------------------- metrics.jsonl

METRICS_LINE = Obj(
    {
        "epoch": Opt(Int(0, 1 << 31)), "group": Str(64), "event": Str(64), "task": Str(256),
        "node": Str(256), "rank": Opt(_COUNT), "seconds": Num(0), "step": Int(0), "time": _SECONDS,
        "values": MapOf(ANY_NUMBER, 1 << 20), "outputs": MapOf(MapOf(ANY_NUMBER, 1 << 20), 1 << 20),
    },
    extra=ANY_NUMBER,  # json.dumps writes a NaN loss as NaN
)


@dataclass(frozen=True)
class MetricsRecord:
    """One line of metrics.jsonl, checked. ``values``/``outputs``: the numbers it logged."""

    epoch: int | None
    group: str | None
    event: str | None
    values: dict[str, Any]
    outputs: dict[str, dict[str, Any]]
    step: int | None = None  # a log record's step (`jobrun plot --x step`)
    task: str | None = None  # the task whose `log` wrote it
    time: float | None = None  # when it was written (seconds since 1970)


def metrics_line(line: str, where: str) -> MetricsRecord | None:
    """One line of metrics.jsonl (``where``: its file:line) as a MetricsRecord; None for
    a blank line or one cut by a kill. Invalid (its message names the file, the line
    and the field) for any other line that is not a record."""
    if not line.strip():
        return None
    try:
        data = parse_json(line, nonfinite=True)
    except Malformed as e:
        raise Invalid(where, f"not a metrics record ({e})") from None
    except ValueError:
        return None  # the job was killed while it wrote this line
    try:
        r = check(data, METRICS_LINE)
    except Invalid as e:
        raise Invalid(f"{where}: field {e.where}", e.what) from None
    return MetricsRecord(r.get("epoch"), r.get("group"), r.get("event"), r.get("values") or {},
                         r.get("outputs") or {}, r.get("step"), r.get("task"), r.get("time"))


# ------------------------------------------------------------------- checkpoint manifests

_NAME = Str(256)
_SAVED = AnyJSON(size=1 << 26)  # what the epoch's tasks output (a text may be long): the manifest bounds it
MONITOR_META = {"monitor": _NAME, "mode": OneOf(("min", "max"))}
CHECKPOINT_META = Obj(
    {
        "epoch": _COUNT, "stop": Bool(), "job": _NAME, "world_size": Int(1, 1 << 20),
        "outputs": MapOf(MapOf(_SAVED, 1 << 20), 1 << 20),
        "best": Obj({**MONITOR_META, "value": Opt(Num())}),
        "early_stop": Obj({**MONITOR_META, "min_delta": Num(), "best": Opt(Num()),
                           "best_epoch": Opt(_COUNT), "wait": _COUNT, "bad_value": Opt(Str()),
                           "bad_epoch": Opt(_COUNT)}),
        "init": MapOf(_SAVED, 1 << 20),
    },
    extra=ANY,
)

_CHUNKS = Obj({"size": Int(0), "chunk_bytes": Int(1), "crc32_chunks": ListOf(Str(8, r"[0-9a-f]{8}"), 1 << 24)},
              required=frozenset({"size", "chunk_bytes", "crc32_chunks"}), extra=ANY)
MANIFEST = Obj(
    {
        "format": Str(64), "version": ANY, "world_size": Int(1, 1 << 20), "rank": _COUNT,
        "node": _NAME, "epoch": _COUNT, "files": MapOf(_CHUNKS, 16), "meta": CHECKPOINT_META,
        "created": _SECONDS, "seconds": _SECONDS,
    },
    required=frozenset({"format", "version", "world_size", "rank", "node", "epoch", "files", "meta"}),
    extra=ANY,
)

COMMIT = Obj({"manifest_sha256": Str(64, r"[0-9a-f]{64}"), "node": _NAME, "epoch": _COUNT,
              "rank": _COUNT, "world_size": Int(1, 1 << 20)},
             required=frozenset({"manifest_sha256"}), extra=ANY)
MODULE_FLAGS = Obj({"training": Bool(), "flipped": ListOf(Str()), "frozen": ListOf(Str())},
                   required=frozenset({"training", "flipped", "frozen"}))
_SIZES = ListOf(Int(0, MAX_INT), 64)
SHARD_FACTS = Obj({"shape": _SIZES, "stride": _SIZES,
                   "placements": ListOf(Str(3, r"S\d{1,2}|R"), 1, 1), "mesh": Int(1, 1 << 20)},
                  required=frozenset({"shape", "stride", "placements", "mesh"}))
