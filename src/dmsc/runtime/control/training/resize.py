"""A training task's data-parallel degree, grown or shrunk between checkpoints.

``dmsc train --dp N`` with N other than the deployment's: before the task's first step the
control plane re-plans the plan's strategy with ``dp = N`` on the plan's cluster (the planner
places the replicas and reserves their paths, as for ``dmsc plan``), checkpoints the weights
and optimizer state (replica 0's: with plain data parallelism every replica holds the same),
stops the workers, starts the new layout and loads the checkpoint into every replica. The task
then trains on from the same step with the same weights and AdamW moments, so the losses are
those of the same training at the new degree (tested against a run that never resized).

The control loop resizes too (:mod:`dmsc.runtime.control.loop.resizing`: devices lost or back,
or the policy's ``elastic`` range on a broken step-time objective). Between tasks it relays the
deployment out at once; during a task it asks the session (:class:`Between`), which makes the
resize before its next step: the inference requests in flight end first (the gates shut, as
for a move), then the same checkpoint, re-plan and load at that step, a checkpoint of the task
at the new layout, and the steps go on. The batches are a function of the step and the global
batch is split among the replicas, so the losses are those of a run that never resized
(tests/integration/test_loop_resize.py, within 1e-4). The decision's row gets the outcome:
the step it was made before and how long it took, or why it was not made.

Refused, with the reason, before the task queues: without the plan's cluster spec (``dmsc up
--cluster``, or found by the plan's cluster name), when the new degree does not fit the cluster
or the task's batch, while the replicas hold task heads (each replica's own: they cannot be
copied into more replicas), or with elastic serving replicas (they hold devices the new
placement may need). The new layout starts with the launcher the old one had: the local one,
or Ray's (its placement groups are given back with the old workers and reserved again for the
new ones).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dmsc.data.db import Database, ScaleEventRecord
from dmsc.planner.plan import Plan
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment, StageLayout
from dmsc.runtime.control.launch.fallback import Restored, restore_newest
from dmsc.runtime.control.training.session import layout_from_plan
from dmsc.spec import ClusterSpec, JobSpec, SpecError, TransformerSpec


def resized_plan(
    plan: Plan,
    model: TransformerSpec,
    cluster: ClusterSpec | None,
    dp: int,
    *,
    heads: bool = False,
    serving: bool = False,
    worker_cpu: Mapping[tuple[int, int], float] | None = None,
    numbered_on: ClusterSpec | None = None,
) -> Plan:
    """The plan of the same strategy at ``dp`` replicas; ValueError says why it cannot be.
    ``worker_cpu``: the CPU % ``plan``'s workers measured, by (stage, replica): the replicas a
    grow adds go to the idlest nodes (:func:`dmsc.planner.elastic.place_grown`).
    ``numbered_on``: the spec ``plan``'s devices and nodes are numbered on, when not
    ``cluster`` (a plan placed on the devices that were online, :mod:`.online`): the load is
    counted on its nodes, then carried over to ``cluster``'s
    (:func:`dmsc.planner.elastic.renumber_load`)."""
    if heads:
        raise ValueError("dp: the replicas hold task heads of their own; they cannot be copied")
    if serving:
        raise ValueError("dp: elastic serving replicas hold devices (dmsc up without --autoscale)")
    if cluster is None:
        raise ValueError(
            f"dp: re-placing replicas needs the cluster spec of {plan.cluster!r} "
            "(dmsc up --cluster PATH)"
        )
    # imported here: the solver brings OR-Tools and pandas (about 0.4 s of CPU) into every
    # control plane's start, and only a resize uses it
    from dmsc.planner.elastic import node_load, place_grown, renumber_load
    from dmsc.planner.solve import plan_job

    try:
        job = JobSpec.model_validate({**plan.job.model_dump(), "dp": dp})
        outcome = plan_job(cluster, model, job, fixed=True)
    except (ValueError, SpecError) as exc:  # DoesNotFit and Infeasible are ValueErrors
        raise ValueError(f"dp: {dp} replicas do not fit cluster {cluster.name!r}: {exc}") from None
    if not worker_cpu:
        return outcome.plan
    on = numbered_on or cluster
    load = renumber_load(node_load(plan, on, worker_cpu), on, cluster)
    return place_grown(plan, outcome.plan, cluster, load)


def check_online(plan: Plan, online: Mapping[str, int] | None) -> None:
    """ValueError when ``plan`` puts more devices in a datacenter than ``online`` says are up
    there (the control loop's view of the Ray nodes alive: the re-plan places on the cluster
    spec, which does not know a node was lost)."""
    if online is None:
        return
    used: dict[str, int] = {}
    for st in plan.stages:
        for rep in st.replicas:
            used[rep.datacenter] = used.get(rep.datacenter, 0) + len(rep.devices)
    over = [(dc, n, online.get(dc, 0)) for dc, n in sorted(used.items()) if n > online.get(dc, 0)]
    if over:
        said = "; ".join(f"{n} devices in {dc}, which has {up} online" for dc, n, up in over)
        raise ValueError(f"dp {plan.job.dp}: the re-plan puts {said}")


def restarter(dep: Deployment) -> Callable[[StageLayout], Deployment]:
    """Stop ``dep``; what starts a layout with the launcher and settings it had (a started
    deployment, stopped again when it fails to start)."""
    settings = {
        "workdir": dep.workdir,
        "registry_ttl_s": dep.registry.ttl_s,
        "step_deadline_s": dep.step_deadline_s,
        "spares": dep.spares.wanted,
        "home": dep.home,
    }
    launcher = dep.launcher  # reusable once closed: the Ray one reserves its groups again
    dep.shutdown()

    def start(layout: StageLayout) -> Deployment:
        new = Deployment(layout, launcher=launcher, **settings)  # type: ignore[arg-type]
        try:
            new.start()
        except BaseException:
            new.shutdown()
            raise
        return new

    return start


def _layout(
    plan: Plan, model: TransformerSpec, device: str, old: StageLayout, spec: ClusterSpec | None
) -> StageLayout:
    layout = layout_from_plan(plan, model, device=device, spec=spec, pack=old.pack_cores)
    layout.link_mbps = old.link_mbps  # the network's links stay as they were
    return layout


def resize(
    dep: Deployment,
    new_plan: Plan,
    model: TransformerSpec,
    step: int,
    folder: Path,
    device: str,
    spec: ClusterSpec | None = None,
) -> tuple[Deployment, Exception | None]:
    """Checkpoint ``dep`` at ``step`` into ``folder``, stop it, and start ``new_plan``'s layout
    with that checkpoint loaded: (the new deployment, None). When the new one cannot start, the
    old layout starts again from the same checkpoint: (that deployment, the error). ``spec``:
    the cluster spec ``new_plan``'s nodes are numbered on (their cpusets)."""
    ckpt = dep.checkpoint(step, folder)
    old_layout = dep.layout
    start = restarter(dep)

    def started(layout: StageLayout) -> Deployment:
        new = start(layout)
        try:
            new.restore(ckpt)
        except BaseException:
            new.shutdown()
            raise
        return new

    try:
        return started(_layout(new_plan, model, device, old_layout, spec)), None
    except Exception as exc:
        return started(old_layout), exc


def restart_from(
    start: Callable[[StageLayout], Deployment],
    old: StageLayout,
    new_plan: Plan,
    model: TransformerSpec,
    device: str,
    candidates: Sequence[Checkpoint],
    spec: ClusterSpec | None = None,
) -> tuple[Deployment, Restored]:
    """Start ``new_plan``'s layout with ``start`` (:func:`restarter` of a deployment that lost
    workers that cannot be replaced: it cannot checkpoint; ``old`` its layout) and load the
    newest of ``candidates`` (newest first) that verifies
    (:func:`~dmsc.runtime.control.launch.fallback.restore_newest`: none that does is the
    caller's to refuse). When the new layout cannot start, the error propagates (and nothing
    of it is left running): the caller may try another (:mod:`.restart`)."""
    new = start(_layout(new_plan, model, device, old, spec))
    try:
        return new, restore_newest(new, candidates)
    except BaseException:
        new.shutdown()
        raise


def record_resize(db: Database, run_id: int, action: str, why: str, plan: Plan) -> None:
    """The change (``train-dp``: a task's new dp; ``loop-dp``: the control loop's resize;
    ``lost-dp``: a task's shrink after a lost node (:mod:`.shrink`); ``redeploy``: a layout
    started again after a shrink that started none; ``move``: a move the orchestrator applied)
    among the deployment's scale events, shown on the dashboard."""
    where = [[st.index, r.datacenter, r.devices] for st in plan.stages for r in st.replicas]
    db.add(
        ScaleEventRecord(
            run_id=run_id,
            action=action,
            replica="training",
            replicas_after=plan.job.dp,
            in_flight=0.0,
            reason=why,
            placement_json=json.dumps(where),
        )
    )


class Resizable(Protocol):
    """What a resize between steps reads and changes of the control plane."""

    deployment: Deployment
    plan: Plan

    @property
    def inference(self) -> Any: ...  # .paused(why, timeout_s): the replicas' gates

    def resized(self, dp: int, online: Mapping[str, int] | None = None) -> Plan: ...

    def relayout(self, plan: Plan, action: str, why: str, step: int | None = None) -> None: ...


@dataclass
class Asked:
    """A resize the control loop asked of the running task, and where its outcome goes."""

    dp: int
    why: str
    done: Callable[[str], None]
    online: Mapping[str, int] | None = None  # devices up by datacenter (None: the spec's)


DRAIN_S = 15.0  # the longest a resize waits for inference requests in flight, per step


class Between:
    """Resizes asked during a training task, made by its session before its next step."""

    def __init__(self, cp: Resizable) -> None:
        self.cp = cp
        self._lock = threading.Lock()
        self._asked: Asked | None = None
        self._task: int | None = None

    @contextmanager
    def running(self, task_id: int) -> Iterator[None]:
        """While ``task_id``'s session runs (inside another's, lent the weights: that one's
        again after); a resize it did not reach is withdrawn after."""
        with self._lock:
            outer, self._task = self._task, task_id
        try:
            yield
        finally:
            with self._lock:
                asked, self._asked, self._task = self._asked, None, outer
            if asked is not None:
                asked.done(f"withdrawn: training task {task_id} ended before its next step")

    def ask(self, asked: Asked) -> int | None:
        """Hand ``asked`` to the running session: its task, or None when no task runs."""
        with self._lock:
            if self._task is not None:
                self._asked = asked
            return self._task

    def __call__(self, step: int) -> Deployment | None:
        """The session's ``swap``, before step ``step``: the deployment it trains on from now
        (None: the same one)."""
        with self._lock:
            asked, self._asked = self._asked, None
        if asked is None:
            return None
        if asked.dp == self.cp.plan.job.dp:  # the session shrank already (.shrink)
            asked.done(f"not needed before step {step}: dp is {asked.dp} already")
            return None
        t0 = time.perf_counter()
        try:
            plan = self.cp.resized(asked.dp, asked.online)  # on the devices online (.online)
            check_online(plan, asked.online)
        except ValueError as exc:
            asked.done(f"not applied: {exc}")
            return None
        old, failed = self.cp.deployment, None
        gates: AbstractContextManager[int] = self.cp.inference.paused(
            f"a resize to dp {asked.dp}", DRAIN_S
        )
        try:
            with gates as left:
                if not left:
                    try:
                        self.cp.relayout(plan, "loop-dp", asked.why, step)
                    except Exception as exc:
                        failed = exc
        except RuntimeError:  # a version is being loaded into the replicas
            left = 1
        if left:  # not at this step boundary: at a later one
            with self._lock:
                self._asked = self._asked or asked
            return None
        if failed is not None:
            asked.done(f"failed before step {step}: {type(failed).__name__}: {failed}")
            if self.cp.deployment is old:
                raise failed
            return self.cp.deployment  # the old layout, started again from the checkpoint
        asked.done(f"applied before step {step}, in {time.perf_counter() - t0:.1f} s")
        return self.cp.deployment
