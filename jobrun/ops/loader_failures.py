"""What a reader over a torch Dataset says when it cannot go on: workers that cannot
start (:func:`iterate`); a sample its dataset failed on (the user's file:line), a batch
its DataLoader could not collate or fetch, a worker that died (:func:`fetch`). The
readers are in :mod:`jobrun.ops.loader` and :mod:`jobrun.ops.stream`."""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from jobrun import hints
from jobrun.errors import RunError
from jobrun.ops.reader import Reader


class SampleError(Exception):
    """A dataset raised while fetching a sample; the message starts with its index.

    Raised in a worker, it comes back as a SampleError whose message holds the worker's
    traceback (torch's rule), where ``sample N: ...`` is found again.
    """


def iterate(reader: Reader, loader: Any) -> Iterator[Any]:
    """iter(loader): its workers start. Started by spawn or forkserver (macOS; Linux from
    Python 3.14), they are sent the dataset and collate_fn pickled: one that cannot be (a
    lambda in it) was torch's warning and multiprocessing's frames shown as the user's."""
    if not loader.num_workers or torch.multiprocessing.get_start_method() == "fork":
        return iter(loader)  # nothing is pickled (and the warnings filters, process-wide, stay as they are)
    try:
        with warnings.catch_warnings():  # torch's, before the error: the message below says it
            warnings.filterwarnings("ignore", "Got pickle error when attempting", UserWarning)
            return iter(loader)
    except Exception as e:
        if not any(f.name == "start" and f.filename.replace("\\", "/").endswith("multiprocessing/process.py")
                   for f in traceback.extract_tb(e.__traceback__)):
            raise
        raise RunError(f"the reader over {reader.options.name} cannot start its workers: "  # type: ignore[attr-defined]
                       f"they start by {torch.multiprocessing.get_start_method()!r}, which sends them the "
                       f"dataset and its collate_fn pickled, and {type(e).__name__}: {e}",
                       hint="keep in the dataset only what pickles: functions defined at a module's top "
                       "level, not a lambda or a local function (or read it with num_workers: 0)") from None


def fetch(reader: Reader, iterator: Iterator[Any]) -> Any:
    """next(iterator), with a failure of the dataset or a worker as one clear RunError."""
    try:
        return next(iterator)
    except StopIteration:
        raise
    except Exception as e:
        reader._stop()  # type: ignore[attr-defined]
        if isinstance(e, SampleError) or str(e).startswith("Caught ") or is_worker_death(e):
            # The message says it all: a worker's traceback is text in torch's exception,
            # whose own frames are torch's; a sample that failed here has the dataset's
            # exception as its cause, with the user's frames.
            raise _failure(reader, e) from e.__cause__ if isinstance(e.__cause__, Exception) else None
        raise _failure(reader, e) from e


_SAMPLE = re.compile(r"(?m)^(?:[\w.]+\.)?SampleError: ((?:samples?) .*)$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_CAUSE = "The above exception was the direct cause of the following exception"


def is_worker_death(e: BaseException) -> bool:
    """Whether ``e`` is torch's error for a DataLoader worker that died (killed, or
    crashed in native code). torch raises it from `next()`, or from its SIGCHLD handler
    in whatever the main thread runs when the signal comes (another op)."""
    return isinstance(e, RuntimeError) and "DataLoader worker (pid" in str(e)


def worker_died(e: BaseException, name: str | None = None) -> RunError:
    """The one message for a dead DataLoader worker (of the reader over ``name``)."""
    of = f" of the reader over {name}" if name else ""
    return RunError(
        f"a DataLoader worker{of} died: {str(e).strip() or type(e).__name__ + ' while taking its batch'}",
        hint="workers die when memory runs out (fewer num_workers or a smaller "
        "prefetch_factor help) or when native code in the dataset crashes; the run "
        f"resumes from its last checkpoint with `{hints.command('resume')}`",
    )


def _failure(reader: Reader, e: Exception) -> RunError:
    name = reader.options.name  # type: ignore[attr-defined]
    text = str(e)
    if isinstance(e, SampleError):
        m = _SAMPLE.search(text)
        what = m.group(1) if m else text
        where = _user_frame(e, text)
        if "could not be collated" in what:
            return RunError(f"dataset {name}: {what}",
                            hint="make every sample of a batch alike (the same fields, of one shape), or "
                            "give the reader a collate_fn that takes them as they are")
        return RunError(
            f"dataset {name}: {what}{f' (at {where})' if where else ''}",
            hint="fix the dataset's __getitem__ for this sample; the run resumes from its "
            f"last checkpoint with `{hints.command('resume')}`",
        )
    # A worker killed while the main process takes its batch's shared memory: the
    # connection ends (EOFError, a reset) before torch's own "worker (pid N) exited".
    if is_worker_death(e) or (isinstance(e, EOFError | ConnectionError) and reader.options.num_workers):
        return worker_died(e, name)
    if isinstance(e, RuntimeError) and "DataLoader timed out" in text:
        return RunError(
            f"the reader over {name}: {text.strip()}",
            hint="a worker took longer than `timeout` for one batch: raise it (0 waits forever)",
        )
    lines = text.strip().splitlines() or [""]
    first, last = lines[0], lines[-1]
    # A worker's error: its last line is the worker's own `Type: message`.
    shown = last if first.startswith("Caught ") else f"{type(e).__name__}: {first}" if first else type(e).__name__
    return RunError(f"the reader over {name} failed: {shown}",
                    hint="check the dataset and the reader's collate_fn")


def _user_frame(e: BaseException, text: str) -> str | None:
    """file:line of the innermost frame of the dataset's own failure, when known."""
    cause = e.__cause__
    if cause is not None and cause.__traceback__ is not None:  # raised in this process
        tb = cause.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
    frames = _FRAME.findall(text.split(_CAUSE)[0])  # the worker's traceback, as text
    if not frames:
        return None
    file, line, fn = frames[-1]
    return f"{file}:{line} in {fn}"
