"""Functions that test plans reach through `call` (tests/ is on sys.path under pytest)."""

from __future__ import annotations

import os
import threading
import time

_lock = threading.Lock()


def append(items: list, value) -> list:
    with _lock:
        items.append(value)
    return items


def new_list() -> list:
    return []


def length(items: list) -> int:
    return len(items)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def fail(message: str = "boom") -> None:
    raise ValueError(message)


def touch(path: str) -> None:
    with open(path, "a"):
        pass


def pid() -> int:
    return os.getpid()


def die_on_rank(epoch: int, rank: int = 1, at: int = 2) -> None:
    """SIGKILL this process when it is replica `rank` reaching epoch `at` (a dying rank)."""
    import signal

    if int(os.environ.get("RANK", 0)) == rank and epoch == at and not os.environ.get("JOBRUN_TEST_NO_DIE"):
        os.kill(os.getpid(), signal.SIGKILL)


def fail_once(path: str, message: str = "bad luck") -> None:
    """Raise the first time (leaving `path` behind), pass every later time."""
    if not os.path.exists(path):
        touch(path)
        raise ValueError(message)


def last_lr(scheduler) -> float:
    return float(scheduler.get_last_lr()[0])
