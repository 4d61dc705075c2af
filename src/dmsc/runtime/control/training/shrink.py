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
2. it re-plans at the new dp on the devices online only (the control plane's ``resized``,
   :class:`~.online.ResizedPlans`: the cluster spec cut down to the launcher's ``capacity``, so
   that no replica lands on a lost device; checked again by :func:`~.resize.check_online`),
   stops the broken deployment and starts the new layout from the newest of the task's
   checkpoints that verifies (:func:`~.resize.restart_from`). A layout that does not start is
   followed by the next smaller dp, down to the floor (:func:`~.restart.start_first`);
3. it records a ``lost-dp`` scale event whose reason names the lost workers (and their node),
   the launcher's error, the new dp and any dp that did not start, and hands the session the
   new deployment with a :class:`~dmsc.runtime.control.launch.recovery.Recovery` (a ``worker``
   fault row).

When no layout starts, the old one is stopped already: the task fails with
:class:`~.restart.NoDeployment` (the cause, every dp tried and why it failed, the checkpoint
kept), the control plane's ``undeployed`` says so in ``dmsc status``, the watchdog leaves the
stopped workers alone, and the next training task first redeploys (:meth:`Shrink.redeploy`:
the plan's strategy at the largest dp the devices online then hold, from the run's newest
checkpoint that verifies; a ``redeploy`` scale event).

The session goes on from that checkpoint: the batches are a function of the step and the global
batch is split among the replicas left, so the losses are those of a run that never lost a node
(tests/integration/test_ray_shrink.py, to 1e-4). Refused before anything stopped, the
launcher's error propagates with the reason added as a note, and the task fails as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment, StageLayout
from dmsc.runtime.control.launch.failures import Key, WorkerFailure
from dmsc.runtime.control.launch.fallback import Restored
from dmsc.runtime.control.launch.recovery import Recovery
from dmsc.runtime.control.training.online import numbered_spec
from dmsc.runtime.control.training.resize import (
    check_online,
    record_resize,
    restart_from,
    restarter,
)
from dmsc.runtime.control.training.restart import NoDeployment, start_first
from dmsc.spec import ClusterSpec, TransformerSpec

log = logging.getLogger("dmsc.control.training")

ACTION = "lost-dp"  # the scale event of a shrink after lost replicas
REDEPLOY = "redeploy"  # the scale event of the deployment a failed shrink left none of


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
    cluster: ClusterSpec | None
    steps_done: int
    undeployed: str | None  # why no deployment is left (None: one is)
    weights_lost: str | None

    @property
    def run(self) -> Any: ...  # .id: the run its scale event belongs to

    @property
    def inference(self) -> Any: ...  # .rebind(dep): the replicas serve from the new one

    def record_services(self) -> None: ...

    def record_refused(self, restored: Restored, task_id: int | None = None) -> None: ...

    def checkpoints(self, task_id: int | None = None) -> list[Checkpoint]: ...

    def resized(self, dp: int, online: Mapping[str, int] | None = None) -> Plan: ...


class Shrink:
    """The session's hook when recovery cannot place a replacement (module docstring)."""

    def __init__(self, cp: Shrinkable) -> None:
        self.cp = cp
        self.dp_min = 1  # the control loop sets its policy's elastic.dp_min
        # what starts a layout with the launcher and settings of the deployment a failed
        # shrink stopped (None: none was stopped)
        self._start: Callable[[StageLayout], Deployment] | None = None

    def replan(self, dp: int, online: Mapping[str, int] | None) -> Plan:
        """The plan at ``dp`` replicas placed on the devices ``online`` (ValueError: none):
        the control plane's re-plan, which keeps the spec the plan is numbered on for a later
        grow (:class:`~.online.ResizedPlans`)."""
        plan = self.cp.resized(dp, online)
        check_online(plan, online)  # the cut-down spec holds no more than online, by its making
        return plan

    def __call__(
        self,
        dep: Deployment,
        failure: WorkerFailure,
        exc: Exception,
        candidates: Sequence[Checkpoint],
        together: bool = False,
    ) -> tuple[Deployment, Recovery]:
        """The deployment the task trains on from now, and the recovery to record; ``exc``
        (the launcher's error), with the reason as a note, when it may not shrink;
        :class:`~.restart.NoDeployment` when it stopped ``dep`` and no smaller layout started.
        ``together``: the replicas differ between steps (they cannot be dropped)."""
        cp, dp = self.cp, dep.layout.replicas
        online = online_of(dep)
        new, refused = decide(cp.plan, list(failure.failed), self.dp_min, online, together)
        if dep is not cp.deployment:
            refused = "the task trains on a deployment of its own"
        lost = sorted({r for _, r in failure.failed})
        stopped: list[Callable[[StageLayout], Deployment]] = []

        def start_at(plan: Plan) -> tuple[Deployment, Restored]:
            if not stopped:  # the broken deployment stops before the first layout starts
                stopped.append(restarter(dep))
            return restart_from(
                stopped[0],
                dep.layout,
                plan,
                cp.model,
                cp.device,
                candidates,
                numbered_spec(cp, plan),
            )

        t0 = time.perf_counter()
        try:
            if refused is not None:
                raise NoDeployment([], refused)
            dps = range(new, max(1, self.dp_min) - 1, -1)
            got = start_first(dps, lambda n: self.replan(n, online), start_at)
        except NoDeployment as err:
            if stopped:  # a layout failed to start after the old one stopped: no workers left
                raise self._undeployed(stopped[0], lost, failure, exc, err, candidates) from exc
            log.warning("no shrink of dp %d after %s: %s", dp, failure, err)
            exc.add_note(f"dp not shrunk: {refused or err}")
            raise exc from None
        plan, new_dep, restored = got.plan, got.deployment, got.restored
        tried = f" ({'; '.join(got.tried)})" if got.tried else ""
        why = (
            f"replica(s) {lost} lost ({failure}) and not replaced ({exc}): dp {dp} -> "
            f"{plan.job.dp}{tried}, from the newest checkpoint that verifies"
        )
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

    def _undeployed(
        self,
        start: Callable[[StageLayout], Deployment],
        lost: list[int],
        failure: WorkerFailure,
        exc: Exception,
        err: NoDeployment,
        candidates: Sequence[Checkpoint],
    ) -> NoDeployment:
        """Record that no deployment is left (``dmsc status`` says why) and return the task's
        error: the cause, every dp tried, and the checkpoint kept for the next task."""
        kept = (
            f"the checkpoint of step {candidates[0].step} is kept"
            if candidates
            else "no checkpoint was taken"
        )
        self._start = start
        self.cp.undeployed = (
            f"no workers since replica(s) {lost} were lost ({failure}; {exc}) and no smaller "
            f"layout started; {kept}; the next training task redeploys on the devices online"
        )
        log.error("training has no deployment: %s (%s)", self.cp.undeployed, err)
        what = f"the shrink after losing replica(s) {lost} ({failure}) started nothing: {kept}"
        return NoDeployment(err.tried, what)

    def redeploy(self) -> None:
        """Before a training task, when a failed shrink left no deployment (``undeployed``):
        start the plan's strategy at the largest dp the devices online now hold (down to the
        floor) with the run's newest checkpoint that verifies loaded;
        :class:`~.restart.NoDeployment` (the state kept) when none starts."""
        cp = self.cp
        if cp.undeployed is None or self._start is None:
            return
        old, start = cp.deployment, self._start
        online = online_of(old)

        def start_at(plan: Plan) -> tuple[Deployment, Restored]:
            return restart_from(
                start,
                old.layout,
                plan,
                cp.model,
                cp.device,
                cp.checkpoints(),
                numbered_spec(cp, plan),
            )

        dps = range(cp.plan.job.dp, max(1, self.dp_min) - 1, -1)
        try:
            got = start_first(dps, lambda n: self.replan(n, online), start_at)
        except NoDeployment as err:
            raise NoDeployment(err.tried, f"training refused: {cp.undeployed}") from None
        cp.undeployed, self._start = None, None
        cp.deployment, cp.plan = got.deployment, got.plan
        cp.inference.rebind(got.deployment)
        cp.record_services()
        cp.record_refused(got.restored)
        ckpt = got.restored.checkpoint
        if got.restored.lost:  # the new workers hold fresh weights: training stays refused
            cp.weights_lost = str(got.restored.error("redeploying after a failed shrink"))
        elif ckpt is not None:
            cp.steps_done = ckpt.step
        at = f"from the checkpoint of step {ckpt.step}" if ckpt is not None else "fresh"
        why = f"redeployed after a failed shrink at dp {got.plan.job.dp}, {at}"
        record_resize(cp.db, cp.run.id, REDEPLOY, why, got.plan)
        log.warning("training %s", why)
