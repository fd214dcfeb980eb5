"""Callables named by a string: an op's implementation, `call`'s `fn`, `build`'s, the
optimizer's and the scheduler's `target`, a loss given by its path.

Two spellings name the same object: "pkg.mod:Name.attr" (the module, then attributes)
and the dotted "pkg.mod.Name" (the longest prefix that imports is the module). A bare
name is a builtin ("max"). Every failure is one RunError saying which argument of which
op named what, why it failed, and how to fix it; the executor adds the plan position.
"""

from __future__ import annotations

import builtins
import importlib
from collections.abc import Callable
from typing import Any

from jobrun.errors import RunError, did_you_mean

_HINT = (
    "check the spelling; is the package installed, or the module in the plan's directory "
    "(which is on the import path while a job runs)?"
)


def resolve(path: Any, op: str, arg: str) -> Callable[..., Any]:
    """The callable `path` names, for argument `arg` of op `op` (both for messages)."""
    what = f"{op}: {arg} {path!r}"
    if not isinstance(path, str) or not path.strip(" .:"):
        raise RunError(f"{what} is not an import path", hint='write "package.module:name"')
    if ":" in path:
        module_name, _, attrs = path.partition(":")
        if not module_name or not attrs:
            raise RunError(f"{what} is not an import path", hint='write "package.module:name"')
        obj = _attributes(_import(module_name, what), attrs.split("."), what)
    elif "." not in path:
        if not hasattr(builtins, path):
            raise RunError(
                f"{what} is not an import path nor a builtin",
                hint=did_you_mean(path, dir(builtins)) or 'write "package.module:name"',
            )
        obj = getattr(builtins, path)
    else:
        module, rest = _longest_module(path.split("."), what)
        obj = _attributes(module, rest, what)
    if not callable(obj):
        raise RunError(f"{what} is a {type(obj).__name__}, not something callable", hint=_HINT)
    return obj


def _import(module_name: str, what: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as e:  # not found, or the module itself failed while importing
        raise _cannot_import(what, e) from e


def _longest_module(parts: list[str], what: str) -> tuple[Any, list[str]]:
    """The module named by the longest importable prefix of `parts`, and the rest."""
    missing: ModuleNotFoundError | None = None
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            return importlib.import_module(name), parts[i:]
        except ModuleNotFoundError as e:
            if not (e.name and (name == e.name or name.startswith(e.name + "."))):
                raise _cannot_import(what, e) from e  # a module it imports is missing
            missing = missing or e
        except Exception as e:
            raise _cannot_import(what, e) from e
    raise _cannot_import(what, missing or ModuleNotFoundError(f"No module named {parts[0]!r}"))


def _cannot_import(what: str, e: BaseException) -> RunError:
    if isinstance(e, ModuleNotFoundError | ImportError) and not isinstance(e.__cause__, Exception):
        hint = _HINT  # not there, or a name misspelt
    elif isinstance(e, SyntaxError):
        hint = f"fix the syntax at {e.filename}:{e.lineno}"
    else:  # the module is there, and failed while importing (its traceback says where)
        hint = "the module raised while it was imported: fix it"
    return RunError(f"{what} cannot be imported: {type(e).__name__}: {e}", hint=hint)


def _attributes(obj: Any, names: list[str], what: str) -> Any:
    for name in names:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            public = [n for n in dir(obj) if not n.startswith("_")]
            owner = getattr(obj, "__name__", type(obj).__name__)
            raise RunError(
                f"{what} cannot be imported: {owner!r} has no attribute {name!r}",
                hint=did_you_mean(name, public) or "check the spelling of the path",
            ) from None
    return obj
