"""``dmsc replan`` against the running control plane: decide now, and apply what was decided.

Between two training tasks (holding the plane's lock, as tasks do), the functional modules read
the run's measurements (:func:`~.advisors.read_measurements`; the plan is the deployment's
current one, which a resize or an earlier move may have changed) and the orchestrator decides
(:func:`decide_on`). A dry run and a real one decide the same way, on the same prediction: the
step time of the job the measured task ran (:func:`~.advisors.prediction.task_prediction`), and an
exception raised within the last ``DEDUPE_S`` is noted as not raised again (a dry run said it
would raise what the real one then did not). ``dmsc replan --dry-run`` asks the running control
plane for this answer, and decides offline (:func:`dry_run_offline`) only when none runs. Unless
the request is a dry run:

- exceptions go into the exception queue;
- an applied move re-plans on the measured figures again and moves the deployment to that plan
  from a checkpoint (:func:`~.loop.moves.apply_move`, which the control loop applies moves
  with too; a re-cut is refused with the reason).

The answer lists every decision with its reason, what was applied, and how long deciding and
moving took.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from dmsc.data.db import Database, RunRecord
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors import default_modules, orchestrate, read_measurements
from dmsc.runtime.control.advisors.base import Measurements, Proposal
from dmsc.runtime.control.advisors.orchestrator import Decision, DecisionRule, apply
from dmsc.runtime.control.advisors.paths import cluster_mismatch
from dmsc.runtime.control.advisors.policy import DEDUPE_S, raised_recently
from dmsc.runtime.control.advisors.prediction import task_prediction, traced_routing
from dmsc.runtime.control.loop.moves import Gates, apply_move
from dmsc.runtime.transport.messages import ReplanRequest
from dmsc.runtime.transport.replies import ReplanReply, parse_reply
from dmsc.spec import ClusterSpec, LayerListSpec, TransformerSpec, resolve_model


def not_again(db: Database, run_id: int, decisions: list[Decision], now_s: float) -> list[Decision]:
    """The decisions with each exception raised within ``DEDUPE_S`` turned into a note (the
    exception queue would not take it again)."""
    out = []
    for d in decisions:
        task = None
        if d.verdict == "raise":
            task = raised_recently(db, run_id, d.proposal.target, now_s)
        if task is None:
            out.append(d)
            continue
        why = f"raised already within the last {DEDUPE_S / 3600:g} h (task {task}): not again"
        out.append(Decision(d.proposal, "note", why))
    return out


def decide_on(
    db: Database,
    run_id: int,
    plan: Plan,
    cluster: ClusterSpec | None,
    model: TransformerSpec | LayerListSpec,
    rule: DecisionRule,
    now_s: float,
) -> tuple[Measurements, list[Decision]]:
    """The run's measurements on ``plan`` (the deployment's current one) with the prediction of
    the job the measured task ran, and the orchestrator's decisions on them."""
    measured = dataclasses.replace(read_measurements(db, run_id, now_s), plan=plan)
    params = next((t.params for t in measured.tasks if t.id == measured.task_id), None)
    # a mixture's routing as the task's traces measured it (advisors.prediction.routed)
    ran = task_prediction(plan, cluster, model, params, traced_routing(plan, measured.traces))
    measured = dataclasses.replace(measured, predicted=ran)
    decisions = orchestrate(default_modules(cluster), measured, rule)
    return measured, not_again(db, run_id, decisions, now_s)


def decisions_doc(m: Measurements, decisions: list[Decision], dry_run: bool) -> dict[str, Any]:
    """What a dry run and a real one answer about the measurements and the decisions."""
    steps = [p.step_s for p in m.metrics]
    return {
        "run": m.run_id,
        "task": m.task_id,
        "dry_run": dry_run,
        "steps_measured": len(steps),
        "median_step_s": statistics.median(steps) if steps else None,
        "remaining_steps": m.remaining_steps,
        **m.prediction().as_json(),
        "decisions": [
            {**d.proposal.as_json(), "decision": d.verdict, "verdict": d.verdict, "why": d.reason}
            for d in decisions
        ],
    }


class NothingMeasured(LookupError):
    """The run has measured nothing yet: there is nothing to decide on."""


class WrongCluster(ValueError):
    """The cluster spec given is not the one the run's plan was made on (``cluster``: its name;
    the message says why)."""

    def __init__(self, cluster: str, why: str) -> None:
        super().__init__(why)
        self.cluster = cluster


def dry_run_offline(
    db: Database,
    run_id: int,
    cluster_of: Callable[[str], ClusterSpec],
    rule: DecisionRule,
    now_s: float,
) -> ReplanReply:
    """``dmsc replan --dry-run`` with no control plane running: run ``run_id``'s measurements on
    its own plan, on the cluster spec ``cluster_of`` gives for the plan's cluster name, decided
    as :func:`replan_now` decides. KeyError for an unknown run, :class:`NothingMeasured`,
    :class:`WrongCluster`."""
    measured = read_measurements(db, run_id, now_s)
    if measured.empty:
        raise NothingMeasured(f"run {run_id} has measured nothing yet: train on it (`dmsc train`)")
    spec = cluster_of(measured.plan.cluster)
    why = cluster_mismatch(measured.plan, spec)
    if why is not None:
        raise WrongCluster(spec.name, why)
    plan = measured.plan
    model = plan.model_spec or resolve_model(plan.model)
    measured, decisions = decide_on(db, run_id, plan, spec, model, rule, now_s)
    doc = {**decisions_doc(measured, decisions, dry_run=True), "cluster": spec.name}
    return parse_reply(ReplanReply, doc)


class Replannable(Protocol):
    """What :func:`replan_now` reads of the control plane (:class:`~.plane.ControlPlane`), and
    the one thing it asks of it: :meth:`relayout` onto a new plan."""

    lock: threading.Lock
    db: Database
    run: RunRecord
    plan: Plan
    cluster: ClusterSpec | None
    model: TransformerSpec

    @property
    def inference(self) -> Gates: ...

    def relayout(self, plan: Plan, action: str, why: str) -> None: ...


def replan_now(cp: Replannable, req: ReplanRequest) -> dict[str, Any]:
    """Decide on the run's measurements now and, unless ``req.dry_run``, apply (module
    docstring). ``cp`` is the control plane (:class:`Replannable`)."""
    with cp.lock:  # between tasks: a training task holds it
        t0 = time.perf_counter()
        rule = DecisionRule(req.threshold, req.horizon_steps)
        measured, decisions = decide_on(
            cp.db, cp.run.id, cp.plan, cp.cluster, cp.model, rule, time.time()
        )
        decide_s = time.perf_counter() - t0
        applied: dict[str, Any] | None = None

        def move(p: Proposal) -> None:
            nonlocal applied
            applied = apply_move(cp, measured.traces, p)

        raised: list[int] = []
        if not req.dry_run:
            raised = apply(cp.db, cp.run.id, decisions, time.time(), move=move)
    return {  # the service sends it as a ReplanReply (.service)
        **decisions_doc(measured, decisions, req.dry_run),
        "cluster": cp.cluster.name if cp.cluster is not None else None,
        "decide_s": decide_s,
        "applied": applied,
        "exceptions_raised": raised,
        "datacenters": [st.datacenter for st in cp.plan.stages],
    }
