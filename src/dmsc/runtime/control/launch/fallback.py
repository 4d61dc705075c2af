"""Which checkpoint a recovery loads: the newest one that verifies.

A checkpoint's files can go missing or be corrupted on disk after they were saved, and the newest
checkpoint is the one a recovery wants. Every recovery (the watchdog's heal of a replica, a
training rollback, the control plane's restart) hands :func:`restore_newest` its candidates,
newest first. Each worker checks its file's SHA-256 (and that it reads) before it loads anything,
and answers DATA_LOSS otherwise (:class:`~dmsc.runtime.control.launch.failures.CheckpointRefused`);
a checkpoint refused by any worker of the group is skipped for the next older one, which every
worker of the group loads, so the group stays at one step.

A refused checkpoint is a fault: :func:`checkpoint_faults` makes its rows (kind ``checkpoint``,
the workers and reasons, the checkpoint fallen back to), which the caller records and logs, and
:func:`dmsc.data.db.Database.refuse_checkpoint` keeps it from being tried again. With candidates
but none that verifies, the caller stops with :class:`NoGoodCheckpoint` (an open fault, the
reason of every refusal): a worker must never go on with fresh weights as if it were restored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from dmsc.data.db import Database, FaultRecord
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment
from dmsc.runtime.control.launch.failures import CheckpointRefused, Key


class NoGoodCheckpoint(RuntimeError):
    """Checkpoints to go back to, but none verifies: the weights cannot be restored."""

    def __init__(self, refusals: Sequence[CheckpointRefused], what: str = "") -> None:
        self.refusals = list(refusals)
        where = f" ({what})" if what else ""
        reasons = "; ".join(str(r) for r in refusals)
        super().__init__(f"no checkpoint verifies{where}" + (f": {reasons}" if reasons else ""))


@dataclass
class Restored:
    """The outcome of :func:`restore_newest`: the checkpoint loaded (None: none was, either
    because there were no candidates or because none verified) and those refused on the way."""

    checkpoint: Checkpoint | None
    refused: list[tuple[Checkpoint, CheckpointRefused]] = field(default_factory=list)

    @property
    def lost(self) -> bool:
        """There were checkpoints, but none verified: the weights are not restored."""
        return self.checkpoint is None and bool(self.refused)

    def error(self, what: str = "") -> NoGoodCheckpoint:
        return NoGoodCheckpoint([r for _, r in self.refused], what)


def restore_newest(
    dep: Deployment, candidates: Sequence[Checkpoint] | None, keys: Collection[Key] | None = None
) -> Restored:
    """Load into the workers of ``keys`` (default all) the first of ``candidates`` (newest
    first; None: none) that every one of them verifies. Other failures (a worker dies)
    propagate."""
    out = Restored(None)
    for ckpt in candidates or ():
        try:
            dep.restore(ckpt, keys)
        except CheckpointRefused as exc:
            out.refused.append((ckpt, exc))
            continue
        out.checkpoint = ckpt
        break
    return out


def checkpoint_faults(
    restored: Restored,
    run_id: int,
    sids: dict[Key, str],
    task_id: int | None = None,
    epoch: int = 0,
) -> list[FaultRecord]:
    """The fault rows of the checkpoints ``restored`` skipped: the workers that refused each and
    why, and the checkpoint fallen back to (none: the fault stays open)."""
    used = restored.checkpoint
    now = time.time()
    rows = []
    for _, exc in restored.refused:
        if used is not None:
            outcome = f"fell back to the checkpoint of step {used.step}"
        else:
            outcome = "no older checkpoint verifies: the weights are not restored"
        rows.append(
            FaultRecord(
                run_id=run_id,
                task_id=task_id,
                kind="checkpoint",
                services=",".join(sids.get(k, "?") for k in sorted(exc.refused)),
                reason=f"{exc}; {outcome}"[:2000],
                detected_at=exc.at,
                recovered_at=now if used is not None else None,
                checkpoint_step=used.step if used is not None else None,
                epoch=epoch,
            )
        )
    return rows


def record_refused(
    restored: Restored,
    dep: Deployment,
    db: Database,
    run_id: int,
    log: logging.Logger,
    task_id: int | None = None,
) -> None:
    """Record and log the checkpoints a recovery skipped (marked refused: they are not tried
    again), with a ``checkpoint`` fault each."""
    for ckpt, exc in restored.refused:
        if ckpt.id is not None:
            db.refuse_checkpoint(ckpt.id, str(exc))
    sids = {k: dep.sid(*k) for k in dep.clients}
    for row in checkpoint_faults(restored, run_id, sids, task_id, dep.epoch):
        db.add(row)
        say = log.error if restored.lost else log.warning
        say("checkpoint fault: %s", row.reason, extra={"run": run_id})
