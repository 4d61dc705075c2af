"""A training task's data-parallel degree, grown or shrunk between checkpoints.

``dmsc train --dp N`` with N other than the deployment's: before the task's first step the
control plane re-plans the plan's strategy with ``dp = N`` on the plan's cluster (the planner
places the replicas and reserves their paths, as for ``dmsc plan``), checkpoints the weights
and optimizer state (replica 0's: with plain data parallelism every replica holds the same),
stops the workers, starts the new layout and loads the checkpoint into every replica. The task
then trains on from the same step with the same weights and AdamW moments, so the losses are
those of the same training at the new degree (tested against a run that never resized).

Refused, with the reason, before the task queues: without the plan's cluster spec (``dmsc up
--cluster``, or found by the plan's cluster name), when the new degree does not fit the cluster
or the task's batch, while the replicas hold task heads (each replica's own: they cannot be
copied into more replicas), with elastic serving replicas (they hold devices the new placement
may need), or with workers on Ray (the local launcher only, for now).
"""

from __future__ import annotations

import json
from pathlib import Path

from dmsc.data.db import Database, ScaleEventRecord
from dmsc.planner.plan import Plan
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.launchers import LocalLauncher
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
    local: bool = True,
) -> Plan:
    """The plan of the same strategy at ``dp`` replicas; ValueError says why it cannot be."""
    if heads:
        raise ValueError("dp: the replicas hold task heads of their own; they cannot be copied")
    if serving:
        raise ValueError("dp: elastic serving replicas hold devices (dmsc up without --autoscale)")
    if not local:
        raise ValueError("dp: resizing restarts the workers with the local launcher only")
    if cluster is None:
        raise ValueError(
            f"dp: re-placing replicas needs the cluster spec of {plan.cluster!r} "
            "(dmsc up --cluster PATH)"
        )
    # imported here: the solver brings OR-Tools and pandas (about 0.4 s of CPU) into every
    # control plane's start, and only a resize uses it
    from dmsc.planner.solve import plan_job

    try:
        job = JobSpec.model_validate({**plan.job.model_dump(), "dp": dp})
        outcome = plan_job(cluster, model, job, fixed=True)
    except (ValueError, SpecError) as exc:  # DoesNotFit and Infeasible are ValueErrors
        raise ValueError(f"dp: {dp} replicas do not fit cluster {cluster.name!r}: {exc}") from None
    return outcome.plan


def resize(
    dep: Deployment, new_plan: Plan, model: TransformerSpec, step: int, folder: Path, device: str
) -> tuple[Deployment, Exception | None]:
    """Checkpoint ``dep`` at ``step`` into ``folder``, stop it, and start ``new_plan``'s layout
    with that checkpoint loaded: (the new deployment, None). When the new one cannot start, the
    old layout starts again from the same checkpoint: (that deployment, the error)."""
    ckpt = dep.checkpoint(step, folder)
    old_layout = dep.layout
    settings = {
        "workdir": dep.workdir,
        "registry_ttl_s": dep.registry.ttl_s,
        "step_deadline_s": dep.step_deadline_s,
        "spares": dep.spares.wanted,
        "home": dep.home,
    }
    dep.shutdown()

    def started(layout: StageLayout) -> Deployment:
        new = Deployment(layout, launcher=LocalLauncher(home=dep.home), **settings)  # type: ignore[arg-type]
        try:
            new.start()
            new.restore(ckpt)
        except BaseException:
            new.shutdown()
            raise
        return new

    layout = layout_from_plan(new_plan, model, device=device)
    layout.link_mbps = old_layout.link_mbps  # the network's links stay as they were
    try:
        return started(layout), None
    except Exception as exc:
        return started(old_layout), exc


def record_resize(db: Database, run_id: int, action: str, why: str, plan: Plan) -> None:
    """The change (``train-dp``: a task's new dp; ``move``: a move the orchestrator applied)
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
