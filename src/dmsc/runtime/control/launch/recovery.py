"""Bringing failed workers back: one algorithm for training and for inference.

:func:`recover` works on a group of workers that must end up consistent: every worker of the
deployment while training (a data-parallel step needs every replica at the same weights), or one
replica's pipeline while serving (:func:`heal`; the other replicas keep answering meanwhile). For
the group it

1. opens a new epoch and fences the failed instances in the registry, before the survivors look
   their peers up again: a fenced SID is refused below the new epoch, so a peer finds the
   replacement or nothing, never a dead address, and a frozen instance that thaws finds itself
   fenced and leaves (it is not killed: it may not be reachable);
2. moves the survivors to the new epoch (``Abort``: their step in progress fails and their stale
   frames are dropped); one that does not answer is taken as failed too;
3. replaces the failed workers, by a warm spare (``Assume``) where one is ready, else by a new
   process, and refills the spares in the background. At tp > 1 every replica of the group is
   replaced, the survivors too, each rank by a spare (one per rank, all of the replica's ranks
   or none) or a new process, whose group meets afresh under the new epoch: the ranks of a
   surviving replica may disagree about the aborted step (a frame of the old epoch reached one
   rank before its ``Abort``, its peer after and was refused; the rank that took it then waits
   in a collective its peer never enters, and the collectives of the next step pair up
   wrongly), and a collective cannot be interrupted;
4. loads into the group the newest of the candidate checkpoints that verifies
   (:func:`dmsc.runtime.control.launch.fallback.restore_newest`: a checkpoint whose file is missing
   or corrupt is skipped, and the :class:`Recovery` lists it); with no candidates every worker must
   still hold its initial weights, as a replacement does. With candidates but none that
   verifies, :attr:`Recovery.lost` is set and the caller must not go on as if restored.

Every worker of the group is loaded with the checkpoint, whatever it applied of the failed step (a
stage applies a step at the end of its part where ``Deployment.applies_in_step`` says so, else on
``Commit`` once every stage finished), so no step is applied twice; the steps after the checkpoint
are run again by the caller.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment
from dmsc.runtime.control.launch.failures import Key, WorkerFailure
from dmsc.runtime.control.launch.fallback import Restored, restore_newest
from dmsc.runtime.control.launch.launchers import WorkerHandle


@dataclass
class Recovery:
    """What one recovery did, for the report and the exception queue."""

    failed: list[str]
    reason: str
    detected_at: float
    recovered_at: float
    checkpoint_step: int
    epoch: int
    restored: Restored = field(default_factory=lambda: Restored(None))

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint the group went back to (None: none, see :attr:`lost`)."""
        return self.restored.checkpoint

    @property
    def lost(self) -> bool:
        """Checkpoints to go back to, but none verified: the group's weights are not restored."""
        return self.restored.lost


def sids(dep: Deployment, key: Key) -> list[str]:
    """The SIDs of the replica at ``key``: one, or one per tensor-parallel rank."""
    return [dep.sid(*key, t) for t in range(dep.layout.tp)]


def fence(dep: Deployment, keys: Collection[Key]) -> None:
    """Refuse the current instances at ``keys`` in the registry (their records go)."""
    for key in keys:
        for sid in sids(dep, key):
            dep.registry.fence(sid, dep.epoch)


def replace(dep: Deployment, keys: Collection[Key]) -> None:
    """Fence the instances at ``keys`` and put replacements at the current epoch in their place
    (warm spares first). The failed instances are kept to be reaped at shutdown. A
    tensor-parallel replica is replaced whole: its ranks meet in a group of the new epoch,
    taken over by a spare each or started as new processes (:meth:`SparePool.take_group`)."""
    fence(dep, keys)
    dep.abandoned.extend(dep.handle(key) for key in keys)
    dep.abandoned.extend(h for k in keys for h in dep.tp.drop(k))
    launch = []
    for key in keys:
        ranks = [dep.config(*key, t) for t in range(dep.layout.tp)]
        # the spares' own SIDs retire once they took over
        taken = dep.spares.take_group(ranks, dep.threads, retire=dep.registry.fence)
        if taken is None:
            launch.extend(ranks)
        else:
            for h in taken:
                _adopt(dep, h)
    for h in dep.launch(launch):
        _adopt(dep, h)
    dep.spares.refill(dep.threads)


def _adopt(dep: Deployment, h: WorkerHandle) -> None:
    if h.config.tp_rank:
        dep.tp.adopt(h, dep.token)
    else:
        dep.adopt(h)


def recover(
    dep: Deployment,
    failure: WorkerFailure,
    candidates: Sequence[Checkpoint] | None,
    keys: Collection[Key] | None = None,
) -> Recovery:
    """Bring the group ``keys`` (default: every worker) back after ``failure``: a new epoch,
    the failed workers of the group replaced, the group at the newest of ``candidates`` (newest
    first; None: none) that verifies (see the module docstring)."""
    group = list(dep.clients) if keys is None else list(keys)
    dep.epoch += 1
    failed = {k for k in failure.failed if k in group}
    fence(dep, failed)  # before the survivors, moving on, look their peers up again
    failed |= set(dep.move_to_epoch([k for k in group if k not in failed], dep.epoch))
    replace(dep, sorted(set(group) if dep.layout.tp > 1 else failed))
    restored = restore_newest(dep, candidates, group)
    ckpt = restored.checkpoint
    return Recovery(
        failed=[sid for k in sorted(failed) for sid in sids(dep, k)],
        reason=str(failure),
        detected_at=failure.at,
        recovered_at=time.time(),
        checkpoint_step=ckpt.step if ckpt is not None else 0,
        epoch=dep.epoch,
        restored=restored,
    )


def heal(
    dep: Deployment,
    failure: WorkerFailure,
    replica: int,
    candidates: Sequence[Checkpoint] | None,
) -> Recovery:
    """Repair one replica's pipeline (inference): :func:`recover` over that pipeline only (at
    ep > 1 over its expert-parallel group's, which serve its requests together)."""
    return recover(dep, failure, candidates, dep.instance(replica))
