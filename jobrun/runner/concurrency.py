"""Threads a task's generated code runs in: `parallel` branches, the tasks of a group,
a task's instances (`run_concurrently`), and `report` bodies repeated every period
while their block runs (`Reports`).

Each thread runs in a copy of the caller's context, so that its optimizer steps count
on the same node (see runner/clock.py).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

Thunk = Callable[[], Any]


def run_concurrently(thunks: list[Thunk], what: str) -> bool:
    """Run thunks in threads (the first in this one); re-raise the first error.

    True when one of them returned true: a generated function does when a `stop_if`
    outside any loop of it fired.
    """
    errors: list[BaseException] = []
    stopped = threading.Event()

    def body(fn: Thunk) -> None:
        try:
            if fn():
                stopped.set()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)

    # Each thread runs in a copy of this context: its optimizer steps count on the same node.
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(body, fn), name=what, daemon=True)
               for fn in thunks[1:]]
    for t in threads:
        t.start()
    body(thunks[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return stopped.is_set()


class Reports:
    """The `report`s of one block: started where they stand, finished when it ends.

    Leaving the block normally, by `break` or by `return` (a stop_if) runs each body
    once more; leaving it by an error or an interruption does not.
    """

    def __init__(self) -> None:
        self.running: list[_Report] = []

    def __enter__(self) -> Reports:
        return self

    def start(self, period: float, body: Thunk) -> None:
        self.running.append(_Report(period, body))

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        for report in reversed(self.running):
            report.finish(final=kind is None)


class _Report:
    """A running `report`: its thread repeats the body every period until `finish`."""

    def __init__(self, period: float, body: Thunk):
        self.period = period
        self.body = body
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,),
                                       name="report", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(self.period):
            try:
                self.body()
            except BaseException as e:  # noqa: BLE001 - re-raised by finish()
                self.error = e
                return

    def finish(self, final: bool) -> None:
        self.stop.set()
        self.thread.join()
        if final:
            if self.error is not None:
                raise self.error
            self.body()

