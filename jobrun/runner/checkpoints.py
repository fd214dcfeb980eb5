"""The job runner's checkpoints: what init built (its fingerprint, checked on resume), the
saves of every node (synchronous, or written by a background thread with
``checkpoint: {async: true}``), their pruning, and the restore a resume starts from.

`Checkpoints` is a part of :class:`jobrun.runner.job.JobRunner` (its base class), kept
apart from the epoch loop; the state these methods share is the runner's own, set in
its ``__init__``. Beyond one `store.write`: :mod:`jobrun.runner.saves`; the reading
back: :mod:`jobrun.runner.restore`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobrun import hints, store
from jobrun.errors import CheckpointError, Interrupted, JobrunError, UsageError
from jobrun.plans import ir
from jobrun.runner import fingerprint, restore, rng
from jobrun.runner.display import human_size
from jobrun.runner.executor import NodeRuntime
from jobrun.runner.saves import Writer, prune_together
from jobrun.safedel import say_kept
from jobrun.store import UnsupportedValue

if TYPE_CHECKING:
    from jobrun.records_schema import MetricsRecord
    from jobrun.runner.display import Display
    from jobrun.runner.job import JobConfig
    from jobrun.runner.monitor import Watch
    from jobrun.runner.records import Metrics
    from jobrun.runner.trackers import Trackers


class Checkpoints:
    """Saving and restoring the nodes' state (see the module docstring)."""

    # The runner's state these methods read and write (JobRunner.__init__ sets it).
    cfg: JobConfig
    plan: ir.Plan
    rank: int
    main_rank: bool
    nodes: dict[str, NodeRuntime]
    display: Display
    metrics: Metrics
    trackers: Trackers | None
    watch: Watch
    ckpt_dir: Path | None
    held: dict[str, frozenset[str]]  # per node: the blobs checkpoints hold
    unsaved: set[str]  # blobs that cannot be checkpointed (resume rebuilds them with init)
    init_fingerprints: dict[str, dict[str, Any]]
    init_rng: dict[str, dict[str, Any]]
    _saving: bool
    _pending_signal: int | None
    _failed_save: int | None
    _save_error: BaseException | None  # why this rank's latest save failed
    _writer: Writer | None
    _buffers: dict[str, store.Prepared]
    _last_saved: int
    step: int  # the global step (a property of the runner)
    _warn: Callable[[str], None]  # a warning on rank 0's console and metrics, else stderr

    def _save(self, epoch: int, stop: bool, outputs: dict | None = None) -> str:
        """Save every node's checkpoint of `epoch`; returns the epoch line's note.

        Synchronous by default. With `async: true` the training thread only copies the
        state to host memory; a background thread writes the files with the same
        `store.write` (still atomic and checksummed), and the next save, the end of the
        job or a signal waits for it. A signal waits from the save's start until the
        caller recorded the epoch (`_stop_if_signalled`).
        """
        if self.ckpt_dir is None:
            return ""
        meta = {"epoch": epoch, "step": self.step, "stop": stop, "job": self.plan.job,
                "world_size": self.cfg.world_size,
                "outputs": {t: {k: short(v) for k, v in o.items()} for t, o in (outputs or {}).items()},
                **self.watch.meta(outputs, epoch)}
        background = bool(self.plan.checkpoint and self.plan.checkpoint.background)
        self._saving = True
        try:
            self._wait_for_writer()
            t0 = time.perf_counter()
            try:
                prepared = {name: self._prepare(node, meta, copy=background)
                            for name, node in self.nodes.items()}
                if not background:
                    total_bytes, seconds = self._write_all(epoch, prepared)
                    return f"ckpt {human_size(total_bytes)} in {seconds * 1000:.0f} ms"
            except (CheckpointError, OSError) as e:
                self._failed_save, self._save_error = epoch, e
                self._warn(f"checkpoint of epoch {epoch} was NOT saved: {e}")
                return "ckpt FAILED"
            blocked = time.perf_counter() - t0
            self._writer = Writer(epoch, lambda: self._write_all(epoch, prepared))
            size = sum(p.tensor_bytes for p in prepared.values())
            return f"ckpt {human_size(size)} async ({blocked * 1000:.0f} ms blocked)"
        except BaseException:
            self._stop_if_signalled(epoch)  # a signal came too: the stop is what to say
            raise

    def _stop_if_signalled(self, epoch: int) -> None:
        """Stop for a signal that came during the save of `epoch` (which it let finish)
        or as the caller recorded the epoch, once it is recorded: its line, its metrics
        record and the trackers' values would otherwise be missing for good, as the
        resume goes on after it. From here on a signal stops the run where it comes."""
        self._saving = False
        if self._pending_signal is not None:
            self._wait_for_writer()
            if epoch == 0 and self._failed_save != 0:
                self._resumable = True  # checkpoint 0 is saved: the stop offers resume
            signum, self._pending_signal = self._pending_signal, None  # a later one stops the stop
            raise Interrupted(signum)

    def _fingerprint_init(self) -> None:
        """Describe what init built that checkpoints do not hold, and the random state it
        left (see runner/fingerprint.py)."""
        if self.ckpt_dir is None:
            return
        for name, node in self.nodes.items():
            held = self.held.get(name, frozenset())
            unsaved = {k: v for k, v in node.globals.items() if k not in held}
            self.init_rng[name] = rng.capture(node.ctx)
            self.init_fingerprints[name] = fingerprint.of_init(unsaved, rng.KEY, self.init_rng[name])

    def _check_init(self, node: str, meta: dict[str, Any], epoch: int) -> None:
        """Resume: init must have built what it built when the run started."""
        saved = meta.get("init") if isinstance(meta, dict) else None
        changed = fingerprint.changes(saved, self.init_fingerprints.get(node, {}), rng.KEY)
        if not changed:
            return
        what = f"init built other things than when the run started (node {node!r}): " + "; ".join(changed)
        if self.cfg.force:
            self._warn(f"{what}; resuming anyway (--force, or overrides that change the plan): the result "
                       "differs from an uninterrupted run")
            return
        raise CheckpointError(
            f"cannot resume from checkpoint epoch {epoch}: {what}",
            hint="checkpoints do not hold what init builds and no step changes: restore the data "
            f"and code init reads, or go on with them as they are: `{hints.resume_again('--force')}`",
        )

    def _prepare(self, node: NodeRuntime, meta: dict[str, Any], copy: bool):
        held = self.held.get(node.name, frozenset())
        blobs = {k: v for k, v in node.globals.items() if k in held and k not in self.unsaved}
        blobs[rng.KEY] = fingerprint.rng_to_save(rng.capture(node.ctx), self.init_rng.get(node.name))
        meta = {**meta, "init": self.init_fingerprints.get(node.name, {})}

        def unsupported(e: UnsupportedValue) -> None:
            if e.blob == rng.KEY:
                raise e
            self.unsaved.add(e.blob)
            self.display.warn(f"blob {e.blob!r} on node {node.name!r} cannot be checkpointed "
                              f"({e.message}); resume rebuilds it with init")

        # Asynchronous saves copy into the previous save's host buffers (its write has
        # finished): touching fresh memory costs more than the copy itself.
        reuse = self._buffers.get(node.name) if copy else None
        prepared = store.prepare(blobs, meta, copy=copy, reuse=reuse, on_unsupported=unsupported)
        if copy:
            self._buffers[node.name] = prepared
        return prepared

    def _write_all(self, epoch: int, prepared: dict[str, Any]) -> tuple[int, float]:
        total_bytes, total_s = 0, 0.0
        for name, p in prepared.items():
            t0 = time.perf_counter()
            result = store.write(p, self.ckpt_dir, name, epoch, rank=self.rank,
                                 world_size=self.cfg.world_size)
            seconds = time.perf_counter() - t0
            total_bytes += result.bytes
            total_s += seconds
            if self.main_rank:
                self.metrics.write({"epoch": epoch, "event": "checkpoint_save", "node": name,
                                    "rank": self.rank, "seconds": round(seconds, 6), "bytes": result.bytes})
        self._last_saved = epoch
        keep = self._keep
        if keep and self.cfg.world_size == 1:  # replicas prune together: _prune_together
            protect = self.watch.protected(self.ckpt_dir, list(self.nodes))
            store.prune(self.ckpt_dir, keep, list(self.nodes), protect=protect)
        return total_bytes, total_s

    def _prune_together(self, resumed: int | None = None) -> None:
        """Replicas: prune after a save, where every rank passes (see saves.prune_together;
        one process prunes right after its write instead, in the writer thread with async
        saves, where collectives cannot run). ``resumed``: the epoch a resume restored,
        which it and the epochs after it (trained again) keep."""
        keep = self._keep
        if not keep or self.ckpt_dir is None or self.cfg.world_size == 1:
            return
        ckpt_dir, nodes = self.ckpt_dir, list(self.nodes)
        prune_together(ckpt_dir, keep, nodes, self.rank, self.cfg.world_size,
                       lambda complete: [*self.watch.protected(ckpt_dir, nodes, complete),
                                         *(e for e in complete if resumed is not None and e >= resumed)],
                       self._warn)

    def _prune_resumed(self, epoch: int) -> None:
        """A stop between a save and its prune (a signal with replicas, a kill) leaves more
        than `keep` epochs, and a run resumed at its end saves none to prune after: the
        resume prunes, as a save would, keeping ``epoch`` and the epochs after it."""
        keep = self._keep
        if not keep or self.ckpt_dir is None:
            return
        if self.cfg.world_size > 1:
            self._prune_together(resumed=epoch)
            return
        nodes = list(self.nodes)
        newer = [e for e in store.complete_epochs(self.ckpt_dir, nodes) if e >= epoch]
        try:
            store.prune(self.ckpt_dir, keep, nodes, protect=[*self.watch.protected(self.ckpt_dir, nodes), *newer])
        except (CheckpointError, OSError) as e:
            self._warn(f"old checkpoints were not pruned: {e}")

    def _wait_for_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        error = writer.wait()
        if error is not None:
            self._failed_save, self._save_error = writer.epoch, error
            self._warn(f"checkpoint of epoch {writer.epoch} was NOT saved: {error}")

    @property
    def _keep(self) -> int | None:
        """`checkpoint.keep` (None: every epoch is kept, or no checkpoints)."""
        return self.plan.checkpoint.keep if self.plan.checkpoint else None

    def _restore(self, epoch: int) -> dict[str, Any]:
        if self.ckpt_dir is None:
            raise CheckpointError("this plan has no `checkpoint` block, so there is nothing to resume")
        c = self.cfg
        loaded, meta = restore.read(
            self.ckpt_dir, self.nodes, epoch, rank=self.rank, world_size=c.world_size,
            saved_world=c.resume_world, hashes=not (c.resume_verified and epoch == c.resume_epoch),
            check_init=self._check_init)
        for name, (blobs, seconds) in loaded.items():
            restore.into(self.nodes[name], blobs, epoch)
            if self.main_rank:
                self.metrics.write({"epoch": epoch, "event": "checkpoint_load", "node": name,
                                    "rank": self.rank, "seconds": round(seconds, 6)})
        if self.rank >= (c.resume_world or c.world_size):  # it restored rank 0's streams
            rng.seed_replica(self.plan.seed, self.rank, epoch)
        return meta

    def _record_lost_epoch(self, epoch: int, meta: dict[str, Any],
                           logged: Callable[[], list[MetricsRecord]]) -> None:
        """Write the epoch record of ``epoch``, the checkpoint a resume (or a restart) goes
        on from, when metrics.jsonl lacks it: a kill -9 after the save, before the record,
        lost it, and the run goes on after the epoch. It is rebuilt from the checkpoint's
        meta (its outputs, rounded as the record rounds them, and its step), marked
        ``"restored": true``; the epoch's time and rates are gone with the process."""
        outputs, step = meta.get("outputs"), meta.get("step")
        if not self.main_rank or epoch == 0 or not isinstance(outputs, dict) or \
                any(r.event == "epoch" and r.epoch == epoch for r in logged()):
            return
        step = step if type(step) is int and step >= 0 else None
        self.metrics.write({"epoch": epoch, **({"step": step} if step is not None else {}), "event": "epoch",
                            "restored": True, "outputs": outputs})
        if self.trackers is not None:  # the CSV file holds what metrics.jsonl holds
            self.trackers.step = max(self.trackers.step, step or 0)
            self.trackers.epoch(epoch, outputs, {})

    def _load_named(self, node: NodeRuntime, live: dict[str, Any], which: int | str) -> None:
        """`checkpoint.load` (in download or exit): the named blobs of checkpoint `which`
        (best, last or a number) into the live objects, read and checked as a resume reads
        them. With replicas rank 0 picks the epoch for all: a monitored value that differs
        per rank must not give the ranks different weights."""
        if self.ckpt_dir is None:  # analyze refuses it: a plan run by another door
            raise CheckpointError("checkpoint.load: this plan has no `checkpoint` block, so it has no checkpoints",
                                  hint="add `checkpoint: {}` to the plan")
        self._wait_for_writer()
        nodes = list(self.nodes)
        if self.cfg.world_size == 1:
            epoch = self._loaded_epoch(which, ())
        else:
            from jobrun.runner.group import gather

            said = gather(store.saved_by(self.ckpt_dir, nodes, self.rank, self.cfg.world_size))
            picked: tuple[int | None, tuple[str, str | None] | None] = (None, None)
            if self.main_rank:
                try:
                    picked = self._loaded_epoch(which, set(said[0]).intersection(*said[1:])), None
                except CheckpointError as e:
                    picked = None, (e.message, e.hint)
            found, error = gather(picked)[0]
            if error is not None:
                raise CheckpointError(*error)
            epoch = found
        saved = store.saved_world_size(self.ckpt_dir, nodes, epoch)
        try:
            loaded, _ = restore.read(self.ckpt_dir, [node.name], epoch, rank=self.rank,
                                     world_size=self.cfg.world_size, saved_world=saved, hashes=True,
                                     check_init=lambda *_: None)
            restore.named(node, loaded[node.name][0], live, epoch)
            failed = None
        except (JobrunError, OSError) as e:
            if self.cfg.world_size == 1:
                raise
            failed = (e.message, e.hint) if isinstance(e, JobrunError) else (
                f"{e.filename}: {e.strerror or e}" if e.filename else str(e), None)
        if self.cfg.world_size > 1:  # a rank's own files failed: every rank stops, none goes on
            from jobrun.runner.group import gather

            bad = [(r, why) for r, why in enumerate(gather(failed)) if why is not None]
            if bad:
                error = CheckpointError(f"checkpoint.load of epoch {epoch} failed on rank {bad[0][0]}: "
                                        f"{bad[0][1][0]}", hint=bad[0][1][1])
                error.every_rank = True
                raise error
        best = self.watch.best
        why = f" (the best by {best.monitor.name.name})" if which == "best" and best is not None else ""
        on = f" on node {node.name!r}" if len(self.nodes) > 1 else ""
        self.display.line(f"loaded {', '.join(live)}{on} from checkpoint epoch {epoch}{why}")

    def _loaded_epoch(self, which: int | str, complete: Collection[int]) -> int:
        """The epoch `checkpoint.load` reads: the best, the newest, or the one named, among
        the complete ones (``complete``: as for store.prunable)."""
        assert self.ckpt_dir is not None
        nodes = list(self.nodes)
        done = sorted({*store.complete_epochs(self.ckpt_dir, nodes), *complete})
        if which == "best":  # the rule of `--epoch best`
            from jobrun.runner.monitor import best_epoch

            try:
                return best_epoch(store.list_checkpoints(self.ckpt_dir), nodes, self.plan, "this run", complete,
                                  instead="give `epoch: last` or an epoch's number")
            except UsageError as e:
                raise CheckpointError(f"checkpoint.load: {e.message}", hint=e.hint) from None
        if which == "last" and done:
            return done[-1]
        if which == "last" or which not in done:
            keep = self._keep
            pruned = f"; `checkpoint.keep: {keep}` deletes the older ones" if keep else ""
            raise CheckpointError(
                f"checkpoint.load: no complete checkpoint of epoch {which} in {self.ckpt_dir}",
                hint=f"the complete ones are epochs {', '.join(map(str, done)) or 'none'}{pruned}; "
                     "`epoch: best` picks by checkpoint.best")
        return int(which)

    def _drop_replaced(self, epoch: int) -> None:
        """A resume that went back (`--epoch`): remove the checkpoints saved after `epoch`,
        which it trains again, once every rank restored its own. Kept, the old run's
        newer epochs were taken for the newest when the new ones stopped short of them (a
        later resume or export went on from the old run), and `keep` pruned the new ones
        first. Only epochs saved before this resume began are removed (a rank restarted
        later must not remove what it saved since)."""
        if self.cfg.world_size > 1:
            from jobrun.runner.group import gather

            gather(None)  # every rank restored: a resume that fails keeps what it had
        resuming = self.cfg.resuming
        if resuming is None or not resuming.drops or not self.main_rank or self.ckpt_dir is None:
            return
        nodes = list(self.nodes)
        old = [e for e in resuming.drops if e > epoch and all(
            _older(store.epoch_dir(self.ckpt_dir, n, e), resuming.started) for n in nodes)]
        try:
            kept = store.delete_epochs(self.ckpt_dir, nodes, old)
        except (CheckpointError, OSError) as e:
            self._warn(f"the checkpoints after epoch {epoch} were not removed: {e}; `{hints.command('resume')}` "
                       f"without --epoch may take one of them for the newest")
            return
        if not old:
            return
        what = f"epoch {old[0]}" if len(old) == 1 else f"epochs {old[0]}-{old[-1]}"
        done = f"removed the checkpoints of {what}, which this resume trains again"
        if kept:  # a damaged manifest, or files of the user's: moved aside, never deleted
            self._warn(f"{done}, but for what jobrun cannot tell it wrote (a damaged manifest, or files "
                       f"of yours), moved aside in {self.ckpt_dir}: {say_kept(kept)}; look at it, then "
                       "delete it")
        else:
            self.display.line(done)


def _older(path: Path, started: float) -> bool:
    """Whether an epoch's directory is gone or was saved before `started`."""
    try:
        return path.stat().st_mtime < started
    except FileNotFoundError:
        return True


# -- helpers ---------------------------------------------------------------------------


def held_blobs(plan: ir.Plan) -> dict[str, frozenset[str]]:
    """What checkpoints hold: per node, the blobs steps after init write or change."""
    from jobrun.plans.state import checkpointed

    return {node: frozenset(names) for node, names in checkpointed(plan).items()}


def short(value: Any) -> Any:
    """A task output as checkpoint meta and the epoch's metrics record keep it."""
    from jobrun.ops.core import plain

    v = plain(value)
    if isinstance(v, float):
        return float(f"{v:.6g}")
    if isinstance(v, list) and len(v) > 8:
        return f"<list len={len(v)}>"
    return v
