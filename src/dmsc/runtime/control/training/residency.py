"""The control plane's residency checks (:mod:`dmsc.spec.residency`) on a deployed plan.

Pure: they take the cluster spec and the plan and return, or raise
:class:`~dmsc.spec.residency.ResidencyError` (a ValueError, so the control plane answers a bad
request) naming the rule.

- A training task reads its ``data`` in the datacenters of the stages that take its tokens:
  every replica of the first stage (the inputs) and of the last (the targets); with
  ``local_data`` each datacenter's replicas read their own shard, in the same datacenters. Every
  stage receives activations computed from them (and sends gradients back), so a rule holding
  derived data (``derived: true``) judges every replica's datacenter. A task also stores
  checkpoints and a model version in the control plane's home (``residency.home``).
- A move (``dmsc replan``, the control loop) puts every stage's weights where the new plan
  places its replicas.
"""

from __future__ import annotations

from dmsc.planner.plan import Plan
from dmsc.spec import ClusterSpec
from dmsc.spec.residency import check_dataset_read, check_model_placement, check_model_store


def reading_datacenters(plan: Plan) -> list[str]:
    """Where a task's tokens are read: the replicas of the first and the last stage."""
    ends = (plan.stages[0], plan.stages[-1]) if plan.stages else ()
    return sorted({rep.datacenter for st in ends for rep in st.replicas})


def holding_datacenters(plan: Plan) -> list[str]:
    """Where ``plan`` puts the model's weights: every replica of every stage."""
    return sorted({rep.datacenter for st in plan.stages for rep in st.replicas})


def check_task(cluster: ClusterSpec | None, plan: Plan, data: str | None, what: str) -> None:
    """A training task on ``plan`` reading ``data`` (resolved) may run: its reading stages may
    read the data, and its checkpoints may be stored at the home."""
    residency = cluster.residency if cluster is not None else None
    if data is not None:
        check_dataset_read(
            residency, data, reading_datacenters(plan), what, carrying=holding_datacenters(plan)
        )
    check_model_store(residency, plan.model, f"{what} (its checkpoints, under the home)")


def check_move(cluster: ClusterSpec | None, plan: Plan, what: str) -> None:
    """The deployment may move to ``plan``: every datacenter it places a stage in may hold the
    model's weights (rules naming any version of it: the deployment may hold any)."""
    residency = cluster.residency if cluster is not None else None
    check_model_placement(residency, plan.model, holding_datacenters(plan), what)
