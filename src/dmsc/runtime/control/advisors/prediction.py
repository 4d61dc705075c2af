"""The prediction a training task's measured step is compared with: the one for the job that ran.

A plan predicts one job: its global batch, its micro-batches, its data-parallel degree, on the
figures of its cluster spec. A task may run another batch (``dmsc train --batch 32``), another
dp (after a resize), or on a cluster spec calibrated again since the plan was made. The step it
measured is compared with:

- the plan's prediction when the task ran the plan's job and the cluster spec is not known (or
  gives the same figure);
- a prediction re-estimated for the job that ran, on the cluster spec in force, when anything
  differs: the plan's placement re-costed there where the task kept its replicas
  (:func:`placed`), else the planner on the same strategy, as ``dmsc plan`` would predict it;
- nothing ("not comparable", with the reason) when the job differs and there is no cluster spec
  to re-estimate on, when the re-estimate fails, or when the cluster's devices were never
  measured (a spec of guessed figures, such as ``local-cpu`` before ``dmsc calibrate``).

The job includes the task's data-parallel synchronisation: a task may train with another sync
mode, round or codec than the plan's (``dmsc train --sync diloco:50 --compress int8``), and is
then re-estimated with its own (:class:`~dmsc.spec.SyncSpec`). Where its replicas agree through
the stage leader (a robust aggregator, central differential privacy or secure aggregation:
:func:`dmsc.runtime.compute.outer_sync.by_collective` false), it is re-estimated with the
leader's star (``via: leader``, :mod:`dmsc.netmodel.sync`) and its rule's passes over the
updates (``aggregator``, :mod:`dmsc.netmodel.leader_work`); it used to be "not comparable", as
the cost model priced the collective only. Central privacy's clip and noise and secure
aggregation's masks are priced too (``sync.privacy``, ``sync.secure``).

A task whose dp changed while it ran (a resize between steps, a shrink after a lost node) has
steps of several jobs: each segment of one dp (:mod:`dmsc.runtime.control.training.report`) is
compared with the prediction for its own dp on the plan it ran on (:func:`predict_segments`),
and the task's median as a whole with none (its steps mix jobs). While the task runs, its
segments so far are compared the same way (:meth:`TaskPredictions.segments`: the session's
report as it grows, read by the dashboard before the task's result holds them).

The job includes a mixture's routing too. A plan at ep > 1 prices the busiest expert-parallel
rank's share of the tokens (``JobSpec.expert_imbalance``, an even share unless the plan was told
or learned one); the runtime counts the tokens each rank got (:mod:`dmsc.data.comm_modes`). A
task whose routing measured otherwise (by more than :data:`SAME_ROUTING`) is compared with the
prediction re-estimated at the routing measured (:func:`routed`), as the recalibration's fit
prices it (:func:`dmsc.data.calibrations.fit_task`). Until 2026-12-05 it was compared at the
plan's: moe-mini's routing measured 1.28 of an even share at ep = 2, and its step 1.41-1.49 of
the plan's prediction against 1.30-1.40 of the prediction at the routing measured
(``benchmarks/results/parallel_modes_cpu.json``, ``reruns_2026_12_05_pm``), so the step-time
objective and the next replan read the routing's cost as the devices' slowness.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dmsc.data.comm_modes import expert_imbalance
from dmsc.data.db import TaskRecord
from dmsc.data.traces import StepTrace
from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.planner.plan import Plan
from dmsc.runtime.compute.outer_sync import by_collective
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.report import Segment, TrainReport
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, SpecError, SyncSpec, TransformerSpec

SAME_REL = 0.01  # a re-estimate within 1% of the plan's is the plan's figure
SAME_ROUTING = 0.02  # a routing measured within 2% of the plan's is the plan's
PLANS = "the plan's"  # the basis of a prediction that is the plan's own figure


@dataclass(frozen=True)
class Prediction:
    """The predicted step time of the job that ran (None: not comparable), and what it is."""

    step_s: float | None
    basis: str  # "the plan's", "re-estimated for ...", or why it is not comparable
    # the step by part, as a plan's prediction breaks it down (the per-mode table's figures);
    # None where there is no figure, or where it was not kept (a prediction read back from JSON)
    breakdown_s: Mapping[str, float] | None = field(default=None, compare=False)

    @property
    def comparable(self) -> bool:
        return self.step_s is not None

    def as_json(self) -> dict[str, Any]:
        return {
            "predicted_step_s": self.step_s,
            "prediction": self.basis,
            "not_comparable": None if self.comparable else self.basis,
        }


def guessed_devices(cluster: ClusterSpec) -> list[str]:
    """Device types whose figures nothing measured: of no known generation (the generic
    constants) and without what ``dmsc calibrate`` writes into a spec."""
    out = []
    for name, dev in sorted(cluster.device_types.items()):
        dc = DEFAULT_CALIBRATION.for_device(dev)
        measured = dc.measured_source is not None or dev.op_overhead_us is not None
        if dc.generation == "generic" and not measured:
            out.append(name)
    return out


def job_words(
    batch: int,
    microbatches: int,
    dp: int,
    sync: SyncSpec | None = None,
    star: str | None = None,
    routing: float | None = None,
) -> str:
    words = f"batch {batch} in {microbatches} micro-batches at dp {dp}"
    if sync is not None:
        words = f"{words}, {sync_words(sync, star)}"
    if routing is not None:
        words = f"{words}, routing {routing:.2f} of an even share"
    return words


def routed(plan: Plan, routing: float | None) -> float | None:
    """The routing a task measured (``routing``: the busiest expert-parallel rank's tokens
    over an even share) as the cost model takes it for ``plan``'s job, where it differs from
    the plan's by more than :data:`SAME_ROUTING`; None where it does not, or the job has no
    expert parallelism or no routing was measured."""
    ep = plan.job.ep
    if routing is None or ep < 2:
        return None
    got = round(min(max(routing, 1.0), float(ep)), 2)  # between even and one rank's all
    planned = plan.job.expert_imbalance
    return None if abs(got - planned) <= SAME_ROUTING * planned else got


def traced_routing(plan: Plan, traces: Sequence[StepTrace]) -> float | None:
    """:func:`routed` of the routing ``traces`` measured (none read where ``plan`` has no
    expert parallelism)."""
    return routed(plan, expert_imbalance(traces)) if plan.job.ep > 1 else None


def sync_words(sync: SyncSpec, star: str | None = None) -> str:
    rounds = "" if sync.mode == "every-step" else f" of {sync.inner_steps} steps"
    words = f"sync {sync.mode}{rounds}, compress {sync.compress}"
    if sync.via == "leader":
        words += f", through the stage leader ({star})" if star else ", through the stage leader"
    return words


def ran_sync(plan: Plan, sync: SyncSettings | None, dp: int = 1) -> SyncSpec:
    """The synchronisation a task ran at ``dp`` replicas, as the cost model names it (None: the
    plan's): through the stage leader where :func:`leader_star` says so."""
    if sync is None:
        return plan.job.sync
    if leader_star(sync, dp) is None:
        return SyncSpec(mode=sync.mode, inner_steps=sync.inner_steps, compress=sync.compress)
    privacy: Literal["none", "clip", "noise"] = "none"
    if sync.privacy_clip is not None:
        privacy = "noise" if sync.privacy_noise > 0 else "clip"
    return SyncSpec(
        mode=sync.mode,
        inner_steps=sync.inner_steps,
        compress=sync.compress,
        via="leader",
        aggregator=sync.aggregator,
        privacy=privacy,
        secure=sync.secure,
    )


def leader_star(sync: SyncSettings | None, dp: int) -> str | None:
    """What makes ``dp`` replicas agree through the stage leader under ``sync`` (the cost
    model's ``via: leader``); None where they agree by collective (or there is one replica)."""
    if sync is None or dp < 2 or by_collective(sync):
        return None
    if sync.secure:
        return "secure aggregation"
    if sync.privacy_clip is not None:
        return "central differential privacy"
    return f"the {sync.aggregator} aggregator"


def prediction_for(
    plan: Plan,
    cluster: ClusterSpec | None,
    model: TransformerSpec | LayerListSpec,
    batch: int,
    microbatches: int,
    dp: int,
    sync: SyncSettings | None = None,
    routing: float | None = None,
) -> Prediction:
    """The prediction for ``batch`` in ``microbatches`` micro-batches per replica at ``dp``
    replicas, synchronised by ``sync`` (None: the plan's), its mixtures' tokens routed as
    measured (``routing``, the busiest expert-parallel rank's over an even share; None: the
    plan's), on ``plan``'s strategy (module docstring)."""
    job = plan.job
    planned = plan.prediction.iteration_time_s
    star = leader_star(sync, dp)
    synced = ran_sync(plan, sync, dp)
    same_sync = synced == job.sync
    imbalance = routed(plan, routing)
    ran = job_words(batch, microbatches, dp, None if same_sync else synced, star, imbalance)
    same = same_sync and (batch, microbatches, dp) == (job.global_batch, job.microbatches, job.dp)
    same = same and imbalance is None
    if cluster is not None and (guessed := guessed_devices(cluster)):
        return Prediction(
            None,
            f"not comparable: device type {', '.join(guessed)} of cluster {cluster.name!r} was "
            "never measured (its figures are guesses): `dmsc calibrate`, then plan on the "
            "calibrated spec",
        )
    if cluster is None:
        if same:
            return Prediction(planned, PLANS, plan.prediction.breakdown_s)
        planned_job = planned_words(job, same_sync, imbalance)
        return Prediction(
            None,
            f"not comparable: the plan predicts {planned_job}, the task ran {ran}, and "
            f"without the cluster spec of {plan.cluster!r} (dmsc up --cluster) it cannot be "
            "re-estimated",
        )
    from dmsc.planner.solve import plan_job

    micro_batch, rest = divmod(batch, microbatches * dp)
    try:
        if rest:
            raise ValueError(f"batch {batch} is not a multiple of {microbatches} x dp {dp}")
        new = JobSpec.model_validate(
            {
                **job.model_dump(),
                "global_batch": batch,
                "micro_batch": micro_batch,
                "dp": dp,
                "sync": synced.model_dump(),
                "expert_imbalance": job.expert_imbalance if imbalance is None else imbalance,
            }
        )
        kept = placed(plan, new, cluster, model)
        if kept is None:
            found = plan_job(cluster, model, new, fixed=True).plan.prediction
            kept = found.iteration_time_s, found.breakdown_s
        step_s, parts = kept
    except (ValueError, SpecError) as exc:  # DoesNotFit and Infeasible are ValueErrors
        return Prediction(None, f"not comparable: {ran} cannot be re-estimated: {exc}")
    if same and abs(step_s - planned) <= SAME_REL * planned:
        return Prediction(planned, PLANS, plan.prediction.breakdown_s)
    if same:
        return Prediction(
            step_s,
            f"re-estimated on the cluster spec now in force (the plan said {planned * 1e3:.1f} "
            "ms on other figures)",
            parts,
        )
    planned_job = planned_words(job, same_sync, imbalance)
    return Prediction(step_s, f"re-estimated for {ran} (the plan's job: {planned_job})", parts)


def planned_words(job: JobSpec, same_sync: bool, imbalance: float | None) -> str:
    """The plan's job in the words of :func:`job_words`: its sync where the task's differs,
    its routing where the task's measured otherwise."""
    routing = None if imbalance is None else job.expert_imbalance
    sync = None if same_sync else job.sync
    return job_words(job.global_batch, job.microbatches, job.dp, sync, None, routing)


def placed(
    plan: Plan, job: JobSpec, cluster: ClusterSpec, model: TransformerSpec | LayerListSpec
) -> tuple[float, dict[str, float]] | None:
    """``job`` on ``plan``'s placement (its stages' layers, datacenters and paths kept) as the
    planner predicts it on ``cluster``, and by part: what ran, when the task kept the plan's
    replicas. None
    when it did not (another dp) or ``cluster`` lacks a datacenter or path of the plan; then
    the search's plan for ``job`` stands in. A search on a re-fitted cluster may place the
    stages otherwise than the plan that was deployed (``dmsc plan --calibrated`` keeps the
    measured placement within its margin): its figure is for a placement that did not run."""
    from dmsc.planner.recalibrate import CannotFit, iteration_s, placed_breakdown_s

    if job.dp != plan.job.dp:
        return None
    ran = plan.model_copy(update={"job": job})
    try:
        return iteration_s(ran, cluster, model), placed_breakdown_s(ran, cluster, model)
    except CannotFit:
        return None


def task_prediction(
    plan: Plan,
    cluster: ClusterSpec | None,
    model: TransformerSpec | LayerListSpec,
    params: dict[str, Any] | None,
    routing: float | None = None,
) -> Prediction:
    """The prediction for a training task of ``plan``'s deployment from its stored ``params``
    (``batch``, ``microbatches``, ``dp``: each the plan's when the task did not set it; no task:
    the plan's job), at the ``routing`` it measured (None: the plan's)."""
    p, job = params or {}, plan.job
    sync = SyncSettings.model_validate(p["sync"]) if p.get("sync") else None
    return prediction_for(
        plan,
        cluster,
        model,
        int(p.get("batch") or job.global_batch),
        int(p.get("microbatches") or job.microbatches),
        int(p.get("dp") or job.dp),
        sync,
        routing,
    )


def stored_routing(task: TaskRecord) -> float | None:
    """The routing a finished task measured, from its result (``expert_imbalance``); None
    where it has none (no expert parallelism, or the task has not ended)."""
    try:
        got = json.loads(task.result_json or "{}").get("expert_imbalance") or {}
    except (ValueError, AttributeError):
        return None
    measured = got.get("measured") if isinstance(got, dict) else None
    return float(measured) if isinstance(measured, int | float) else None


class TaskPredictions:
    """:func:`task_prediction` of each training task, kept by (task, deployed plan): a task's
    prediction re-plans once per plan it is read under. And the segments of the tasks running
    now, each beside the prediction for its dp on the plan it ran on: the session hands its
    report over as it makes it (:meth:`begin`), and the dashboard reads the segments so far
    (:meth:`segments`) before the task's result holds them."""

    RUNNING = 4  # the newest tasks' reports kept (one is read while it runs, then not again)

    def __init__(self, routing: Callable[[int], float | None] | None = None) -> None:
        # a running task's routing measured so far, by task id (a mixture's; None: the plan's)
        self._routing = routing
        self._kept: dict[tuple[int, int, float | None], tuple[Plan, Prediction]] = {}
        self._lock = threading.Lock()  # the dashboard's threads read, the sessions' begin
        self._running: dict[int, tuple[TrainReport, TrainParams]] = {}
        # by (plan, dp, batch, micro-batches): each segment's re-estimate once
        self._made: dict[tuple[object, ...], tuple[Plan, Prediction]] = {}

    def begin(self, task_id: int, params: TrainParams, report: TrainReport) -> None:
        """Task ``task_id`` (run with ``params``) reports into ``report`` from now."""
        with self._lock:
            self._running.pop(task_id, None)
            self._running[task_id] = (report, params)
            for old in list(self._running)[: -self.RUNNING]:
                del self._running[old]

    def segments(
        self,
        task_id: int,
        plan: Plan,
        cluster: ClusterSpec | None,
        model: TransformerSpec | LayerListSpec,
    ) -> list[dict[str, Any]] | None:
        """The segments task ``task_id`` ran so far, as its result will have them (a segment
        not told its plan ran on ``plan``, the one in force), at the routing it measured so far
        (a mixture's); None: no report of it here."""
        with self._lock:
            got = self._running.get(task_id)
        if got is None:
            return None
        report, params = got
        routing = self._routing(task_id) if self._routing and plan.job.ep > 1 else None
        out = []
        for seg in list(report.segments):  # the session's thread appends: read copies
            on = seg.plan or plan
            imbalance = routed(on, routing)
            key = (id(on), seg.dp, params.batch, params.microbatches, params.sync, imbalance)
            with self._lock:
                kept = self._made.get(key)
            if kept is None or kept[0] is not on:
                made = prediction_for(
                    on,
                    cluster,
                    model,
                    params.batch,
                    params.microbatches,
                    seg.dp,
                    params.sync,
                    imbalance,
                )
                with self._lock:
                    if len(self._made) > 4 * self.RUNNING:
                        self._made.clear()
                    kept = self._made[key] = (on, made)
            copy = Segment(seg.first_step, seg.dp, on, list(seg.step_s), kept[1].as_json())
            out.append(copy.as_json())
        return out

    def get(
        self,
        task: TaskRecord,
        plan: Plan,
        cluster: ClusterSpec | None,
        model: TransformerSpec | LayerListSpec,
    ) -> Prediction:
        routing = routed(plan, stored_routing(task))  # a finished task's, from its result
        key = (task.id, id(plan), routing)
        if key not in self._kept or self._kept[key][0] is not plan:
            params = json.loads(task.params_json or "{}")
            self._kept[key] = (plan, task_prediction(plan, cluster, model, params, routing))
        return self._kept[key][1]


def predict_segments(
    report: TrainReport,
    plan: Plan,
    cluster: ClusterSpec | None,
    model: TransformerSpec | LayerListSpec,
    params: TrainParams,
    routing: float | None = None,
) -> Prediction:
    """Set the prediction of each of ``report``'s segments (the task's batch in its
    micro-batches, ``params``, at the segment's dp, on the plan it ran on: ``plan``, the one in
    force now, when the session was not told; at the ``routing`` the task measured, None the
    plan's) and of the task as a whole, and give the latter: ``plan``'s job when every segment
    ran at its dp, none when the dp changed (module docstring)."""
    made: dict[tuple[int, int], Prediction] = {}  # by (plan, dp): each re-estimate once

    def predict(on: Plan, dp: int) -> Prediction:
        key = (id(on), dp)
        if key not in made:
            made[key] = prediction_for(
                on, cluster, model, params.batch, params.microbatches, dp, params.sync, routing
            )
        return made[key]

    for seg in report.segments:
        seg.prediction = predict(seg.plan or plan, seg.dp).as_json()
    dps = [seg.dp for seg in report.segments]
    changed = any(dp != plan.job.dp for dp in dps)  # else the plan's job, as for a task that
    whole = mixed(dps) if changed else predict(plan, plan.job.dp)  # never changed dp
    report.prediction = whole.as_json()
    return whole


def mixed(dps: list[int], running: bool = False) -> Prediction:
    """The task-wide prediction of a task whose segments ran at ``dps``: none."""
    ran = " -> ".join(str(dp) for dp in dps)
    at = f"runs at dp {ran} so far" if running else f"ran at dp {ran}"
    return Prediction(None, f"not comparable: the task {at}; each segment has its own prediction")
