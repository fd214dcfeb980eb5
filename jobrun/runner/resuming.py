"""What a resume changes in its run directory, and when: once the checkpoint is restored.

`jobrun resume` checks what it can before it starts (the plan, the code, the checkpoint's
files), but only the job itself finds out whether the checkpoint fits what init built (a
changed `vars.hidden` gives weights of another shape). So the resume's record waits for
that: rank 0 writes it right after the restore. A resume that fails or is interrupted
before leaves run.json, plan.yaml and metrics.jsonl as they were (console.log has what it
printed), and a plain `jobrun resume` goes on as if it had never been tried; before, the
failed attempt's overrides were stored as the run's, so every later resume failed too.

A rank the elastic agent restarts gets the same record: it is written once (`started`,
the time the resume began, tells whether run.json holds it already).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobrun.errors import JobrunError
from jobrun.runner.rundir import RunDir

if TYPE_CHECKING:
    from jobrun.records_schema import MetricsRecord


@dataclass(frozen=True)
class Resuming:
    epoch: int  # the checkpoint resumed from
    sets: tuple[str, ...]  # the overrides given to this resume
    changes: tuple[str, ...]  # what they change (`key: old -> new`)
    stored: Any  # the changed plan's tree, to store as plan.yaml (None: unchanged)
    replicas: int
    saved: int  # the replicas that wrote the checkpoint
    restarts: int
    # The epochs saved after `epoch` that the resume trains again (`--epoch` went back, or
    # they are damaged): removed once the checkpoint is restored (JobRunner._drop_replaced),
    # so that none of them is taken for the newest when the new ones stop short of them,
    # and none stands in the way of its new save.
    drops: tuple[int, ...] = ()
    started: float = field(default_factory=lambda: round(time.time(), 6))

    def recorded(self, run: RunDir) -> bool:
        """Whether run.json holds this record (a restarted rank's resume wrote it)."""
        try:
            return run.info().started == self.started
        except JobrunError:
            return False

    def record(self, run: RunDir) -> list[MetricsRecord]:
        """Write it (rank 0, the checkpoint restored): metrics after the epoch dropped,
        the changed plan stored, run.json saying running, resumed from the epoch. The
        metrics records kept."""
        import yaml

        info = run.info()
        kept = run.truncate_metrics(self.epoch)
        facts: dict[str, Any] = {}
        if self.changes:
            run.write_plan(yaml.safe_dump(self.stored, sort_keys=False))
            facts = {"sets": [*(info.sets or []), *self.sets],
                     "changes": [*(info.changes or []), {"from_epoch": self.epoch, "sets": list(self.sets),
                                                         "changed": list(self.changes)}]}
        if self.saved != self.replicas:
            facts["replica_changes"] = [*(info.replica_changes or []),
                                        {"from_epoch": self.epoch, "from": self.saved, "to": self.replicas}]
        run.update_info(status="running", resumed_from=self.epoch, started=self.started, error=None,
                        error_at=None, replicas=self.replicas, max_restarts=self.restarts, **facts)
        return kept
