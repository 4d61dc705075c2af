"""A training task that lost replicas for good shrinks its data-parallel degree and trains on.

When a Ray node holding workers of a data-parallel replica is lost, the session's recovery
(:mod:`dmsc.runtime.control.launch.recovery`) starts replacements in the same datacenter; with no
node of it left with room, the launcher raises
:class:`~dmsc.runtime.control.launch.launchers.WorkerStartError`. The session then calls
:class:`Shrink` (its ``shrink`` hook, owned by the control plane), which drops the lost replicas:

1. it decides (:func:`decide`): the replicas of the failed workers go, and dp falls by their
   number, not below the floor: the policy's ``elastic.dp_min`` when the control loop runs with
   one, 1 otherwise (by default any deployment of dp > 1 may shrink, since the task would
   otherwise fail: a policy that needs more replicas says so with ``dp_min``). It shrinks only
   when the devices online (the launcher's ``capacity``: the Ray nodes alive) really fall short
   of what the replicas hold, and not while the replicas differ between steps (sync modes that
   keep them apart, task heads);
2. it re-plans at the new dp (:meth:`~dmsc.runtime.control.plane.ControlPlane.resized`, checked
   against the devices online by :func:`~.resize.check_online`), stops the broken deployment
   and starts the new layout from the newest of the task's checkpoints that verifies
   (:func:`~.resize.restart_from`);
3. it records a ``lost-dp`` scale event whose reason names the lost workers (and their node),
   the launcher's error and the new dp, and hands the session the new deployment with a
   :class:`~dmsc.runtime.control.launch.recovery.Recovery` (a ``worker`` fault row).

The session goes on from that checkpoint: the batches are a function of the step and the global
batch is split among the replicas left, so the losses are those of a run that never lost a node
(tests/integration/test_ray_shrink.py, to 1e-4). Refused, the launcher's error propagates with
the reason added as a note, and the task fails as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment
from dmsc.runtime.control.launch.failures import Key, WorkerFailure
from dmsc.runtime.control.launch.recovery import Recovery
from dmsc.runtime.control.training.resize import check_online, record_resize, restart_from
from dmsc.spec import TransformerSpec

log = logging.getLogger("dmsc.control.training")

ACTION = "lost-dp"  # the scale event of a shrink after lost replicas


def decide(
    plan: Plan,
    failed: Collection[Key],
    dp_min: int,
    online: Mapping[str, int] | None,
    together: bool = False,
) -> tuple[int, str | None]:
    """The dp left once the replicas of the ``failed`` workers of ``plan``'s deployment are
    dropped, and why that shrink may not be made (None: it may; module docstring, step 1).
    ``online``: the devices online by datacenter (None: the launcher cannot say)."""
    dp = plan.job.dp
    lost = sorted({r for _, r in failed})
    if not lost:
        return dp, "the failure names no worker"
    if together:
        return dp, "the replicas differ between steps (a sync mode or task heads)"
    if online is None:
        return dp, "the launcher cannot say which devices are online"
    try:
        check_online(plan, online)
    except ValueError:
        pass  # short of devices: a node was lost
    else:
        return dp, f"the devices online ({dict(online)}) still hold every replica: none was lost"
    new, floor = dp - len(lost), max(1, dp_min)
    if new < floor:
        return new, (
            f"dropping replica(s) {lost} leaves dp {new}, below {floor} (the policy's elastic "
            "dp_min, or 1)"
        )
    return new, None


def online_of(dep: Deployment) -> Mapping[str, int] | None:
    """The devices online by datacenter as the launcher sees them (None: it cannot say; the
    local launcher's devices never go)."""
    capacity = getattr(dep.launcher, "capacity", None)
    return capacity() if capacity is not None else None


class Shrinkable(Protocol):
    """What a shrink reads and changes of the control plane."""

    deployment: Deployment
    plan: Plan
    db: Database
    model: TransformerSpec
    device: str

    @property
    def run(self) -> Any: ...  # .id: the run its scale event belongs to

    @property
    def inference(self) -> Any: ...  # .rebind(dep): the replicas serve from the new one

    def record_services(self) -> None: ...

    def resized(self, dp: int) -> Plan: ...


class Shrink:
    """The session's hook when recovery cannot place a replacement (module docstring)."""

    def __init__(self, cp: Shrinkable) -> None:
        self.cp = cp
        self.dp_min = 1  # the control loop sets its policy's elastic.dp_min

    def __call__(
        self,
        dep: Deployment,
        failure: WorkerFailure,
        exc: Exception,
        candidates: Sequence[Checkpoint],
        together: bool = False,
    ) -> tuple[Deployment, Recovery]:
        """The deployment the task trains on from now, and the recovery to record; ``exc``
        (the launcher's error), with the reason as a note, when it may not shrink.
        ``together``: the replicas differ between steps (they cannot be dropped)."""
        cp, dp = self.cp, dep.layout.replicas
        online = online_of(dep)
        new, refused = decide(cp.plan, list(failure.failed), self.dp_min, online, together)
        if dep is not cp.deployment:
            refused = "the task trains on a deployment of its own"
        plan = cp.plan
        if refused is None:
            try:
                plan = cp.resized(new)
                check_online(plan, online)
            except ValueError as err:
                refused = str(err)
        if refused is not None:
            log.warning("no shrink of dp %d after %s: %s", dp, failure, refused)
            exc.add_note(f"dp not shrunk: {refused}")
            raise exc
        lost = sorted({r for _, r in failure.failed})
        why = (
            f"replica(s) {lost} lost ({failure}) and not replaced ({exc}): dp {dp} -> {new}, "
            f"from the newest checkpoint that verifies"
        )
        t0 = time.perf_counter()
        new_dep, restored = restart_from(dep, plan, cp.model, cp.device, candidates)
        cp.deployment, cp.plan = new_dep, plan
        cp.inference.rebind(new_dep)
        cp.record_services()
        record_resize(cp.db, cp.run.id, ACTION, f"{why}, in {time.perf_counter() - t0:.1f} s", plan)
        log.warning("training shrank: %s", why)
        ckpt = restored.checkpoint
        return new_dep, Recovery(
            failed=[dep.sid(*k) for k in sorted(failure.failed)],
            reason=why,
            detected_at=failure.at,
            recovered_at=time.time(),
            checkpoint_step=ckpt.step if ckpt is not None else 0,
            epoch=new_dep.epoch,
            restored=restored,
        )
