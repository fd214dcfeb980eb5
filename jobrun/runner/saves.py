"""The runner's checkpoint writes beyond one `store.write`: a write in the background
(``checkpoint: {async: true}``), and the pruning that the ranks of a job do together."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection

from jobrun import store
from jobrun.errors import CheckpointError


class Writer:
    """One background checkpoint write; `wait` returns its error (or None)."""

    def __init__(self, epoch: int, fn):
        self.epoch = epoch
        self.error: BaseException | None = None
        self.done = threading.Event()  # not join's state: an interrupted join marks a running thread stopped

        def run() -> None:
            try:
                fn()
            except (CheckpointError, OSError) as e:
                self.error = e
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self) -> BaseException | None:
        """Its error (or None) once the write is done. A signal that comes meanwhile (a
        second Ctrl-C as the run stops) is raised after it: leaving at once, the process
        was aborted in the middle of the write (SIGABRT), its checkpoint half written."""
        stopped: BaseException | None = None
        while not self.done.is_set():
            try:
                self.done.wait()
            except BaseException as e:  # noqa: BLE001 - jobrun's Interrupted, KeyboardInterrupt
                stopped = stopped or e
        if stopped is not None:
            raise stopped
        return self.error


def prune_together(ckpt_dir: os.PathLike[str], keep: int, nodes: list[str], rank: int, world: int,
                   protected: Callable[[Collection[int]], list[int]],
                   warn: Callable[[str], None]) -> None:
    """Delete the saved epochs that `checkpoint.keep` no longer keeps; every rank of the
    job calls it at the same point, after a save. An epoch still being written in the
    background counts from the next call.

    The ranks decide together: each says which epochs it saved, since on hosts without a
    shared disk each host holds only its own ranks' files and none sees a complete epoch;
    rank 0 picks what goes (``protected(complete)``: the epochs checkpoint.best keeps), and
    the first rank of each host deletes it there. A rank that cannot read or delete only
    warns: the collectives go on, and nothing is deleted that not every rank saved a
    newer copy of."""
    from jobrun.runner.group import gather

    try:
        mine = store.saved_by(ckpt_dir, nodes, rank, world)
    except (CheckpointError, OSError) as e:
        warn(f"old checkpoints were not pruned: {e}")
        mine = []
    said = gather(mine)
    complete = set(said[0]).intersection(*said[1:])
    doomed: list[int] = []
    if rank == 0:
        try:
            doomed = store.prunable(ckpt_dir, keep, nodes, protected(complete), complete)
        except (CheckpointError, OSError) as e:
            warn(f"old checkpoints were not pruned: {e}")
    doomed = gather(doomed)[0]
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:
        try:
            store.delete_epochs(ckpt_dir, nodes, doomed)
        except (CheckpointError, OSError) as e:
            warn(f"old checkpoints were not pruned: {e}")
