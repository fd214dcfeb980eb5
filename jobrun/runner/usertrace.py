"""The user's own frames of an error raised in the user's code (a `call`ed function, a
built class, a loss named by import path): what the user needs to fix it, without
jobrun's generated code and internals around it.

A frame is the user's when its file lies outside jobrun and outside the Python
installation's libraries (the standard library, site-packages): a plan's `models.py`, a
package on PYTHONPATH. Shown are the user's frames and, when the error was raised inside
a library, the frame that raised it (torch's `F.linear(...)` line of a shape error); the
library frames in between (torch's module call glue, autograd's engine) are left out.
When no frame is the user's (the user's code is an installed package, or the error came
from torch called directly by an op), the frames outside jobrun and torch are shown, and
torch's frame that raised.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import jobrun
from jobrun.errors import cut

_JOBRUN = str(Path(jobrun.__file__).resolve().parent)
_LIBRARIES = tuple(sorted({str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(key))}))


@dataclass(frozen=True)
class UserTrace:
    function: str  # module.qualname of the outermost user frame (the function jobrun called)
    text: str  # the traceback of the user's frames and the exception, as Python prints it


def _inside(filename: str, roots: tuple[str, ...]) -> bool:
    if filename.startswith("<"):  # generated code (the executor's), <string>, <frozen ...>
        return True
    try:
        path = str(Path(filename).resolve())
    except (OSError, RuntimeError):
        return False
    return any(path == r or path.startswith(r + "/") for r in roots)


# Frames that only pass a call on: torch's Module.__call__ and autograd's engine, and
# importlib's import_module (a module that is not found raises there).
_GLUE_FUNCTIONS = frozenset({"_call_impl", "_wrapped_call_impl", "_engine_run_backward"})
_GLUE_DIRS = tuple(f"{os.sep}torch{os.sep}{d}{os.sep}" for d in ("autograd", "_dynamo", "_functorch"))
_IMPORTLIB = f"{os.sep}importlib{os.sep}__init__.py"
_TORCH = f"{os.sep}torch{os.sep}"


def _glue(tb: TracebackType) -> bool:
    code = tb.tb_frame.f_code
    return (code.co_name in _GLUE_FUNCTIONS or any(d in code.co_filename for d in _GLUE_DIRS)
            or code.co_filename.endswith(_IMPORTLIB))


def of(error: BaseException) -> UserTrace | None:
    """The user's part of ``error``'s traceback (or of the first exception in its chain of
    causes that is no jobrun error), or None when no frame outside jobrun is in it."""
    from jobrun.errors import JobrunError

    seen: BaseException | None = error
    for _ in range(8):
        if not isinstance(seen, JobrunError):
            break
        seen = seen.__cause__
    if seen is None or isinstance(seen, JobrunError):
        return None
    entries: list[TracebackType] = []
    tb = seen.__traceback__
    while tb is not None:
        if not _inside(tb.tb_frame.f_code.co_filename, (_JOBRUN,)):
            entries.append(tb)
        tb = tb.tb_next
    if not entries:
        return None
    mine = [not _inside(t.tb_frame.f_code.co_filename, _LIBRARIES) for t in entries]
    if any(mine):  # the user's frames, and the library frame that raised
        last = len(entries) - 1
        entries = [t for k, t in enumerate(entries) if mine[k] or (k == last and not _glue(t))]
    else:  # an installed package's frames are shown; torch's only where it raised
        last = len(entries) - 1
        entries = [t for k, t in enumerate(entries)
                   if not _glue(t) and (k == last or _TORCH not in t.tb_frame.f_code.co_filename)]
        if not entries:  # importlib's frames of a module not found: the message says it all
            return None
    summary = traceback.StackSummary.extract((t.tb_frame, t.tb_lineno) for t in entries)
    # the exception's text, said in full once is enough
    last_line = cut("".join(traceback.format_exception_only(type(seen), seen)).rstrip("\n")) + "\n"
    text = "".join(summary.format()) + last_line
    frame = entries[0].tb_frame
    module = frame.f_globals.get("__name__")
    name = frame.f_code.co_qualname
    return UserTrace(f"{module}.{name}" if isinstance(module, str) else name, text)


def hint_for(error: BaseException) -> str | None:
    """A hint for the commonest errors of a port: a batch whose dtype is not the model's
    (torch says "mat1 and mat2 must have the same dtype, but got Double and Float"), and a
    forward that takes a state beside the batch (an RNN's `forward(input, hidden)`)."""
    if isinstance(error, TypeError) and re.search(r"forward\(\) missing \d+ required positional", str(error)):
        return ("train.step and evaluate call `model(x)` (with `loss: model`, `model(x, y)`); a "
                "forward that takes more, an RNN's hidden state say, is stepped by a `call` of yours "
                "that gives it (docs/plan-language.md section 12, a value carried from step to step)")
    text = str(error) if isinstance(error, RuntimeError) else ""
    if "must have the same dtype" not in text and "expected scalar type" not in text:
        return None
    if "Double" in text:
        return ("a float64 batch (numpy's default) met float32 weights: give the model float32 "
                "data (`.float()`, or np.float32 in a Dataset's __getitem__; data.load casts floats "
                "to float32 unless float_dtype says otherwise)")
    if "Long" in text or "Int" in text:
        return "an integer batch met float weights: give the model float inputs (`.float()`)"
    return None
