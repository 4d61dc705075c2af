"""Recalibrations kept in the database: a training task's step traces fitted to the cluster its
plan was made for (:mod:`dmsc.planner.recalibrate`), one row per task
(:class:`~dmsc.data.calibration_records.RecalibrationRecord`).

What a run measured (:func:`run_figures`), from its traces, its warm-up steps left out as the
task's median step leaves them out (the first fifth):

- a stage's compute per micro-batch: its forward and backward spans in a step over the
  micro-batches (the worker's ``compute_s`` when it reported no spans), median over the steps
  and replicas;
- a boundary's transfer per micro-batch: the gap from the end of stage ``s``'s op on a
  micro-batch to the start of stage ``s+1``'s on the same one (forward; backward the other way).
  A gap holds the transfer and any wait for a busy receiver, so a step's smallest gap is taken
  (its first micro-batch finds the receiver idle), then the median over the steps and replicas;
  its bytes: what stage ``s`` sent to ``s+1`` in a step (all replicas, as the planner counts
  them) over the micro-batches. Spans are wall-clock times: across machines a gap holds their
  clock skew.

A fit learns from every run of the same placement, not from the last alone: a task's figures are
pooled with those of the up to four newest earlier fitted tasks whose run's plan places the same
job the same way on the same cluster (:func:`earlier_tasks`), their warm steps and spans taken
together. On this project's 2-core machine a 200-step task's median step moves by a few percent
from one spell to the next; one task's fit carries its spell into the next prediction whole.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import select

from dmsc.data.calibration_records import RecalibrationRecord
from dmsc.data.comm_modes import expert_imbalance
from dmsc.data.db import Database, RunRecord
from dmsc.data.traces import StepTrace, step_traces
from dmsc.planner.plan import Plan
from dmsc.planner.recalibrate import CannotFit, Fit, RunFigures, fit_run
from dmsc.spec import ClusterSpec


def warm(traces: Sequence[StepTrace]) -> list[StepTrace]:
    """``traces`` without their warm-up steps (the first fifth, as the median step skips)."""
    steps = sorted({t.step for t in traces})
    kept = set(steps[len(steps) // 5 :] or steps)
    return [t for t in traces if t.step in kept]


def run_figures(
    traces: Sequence[StepTrace], microbatches: int, step_s: float, warmed: bool = False
) -> RunFigures:
    """What the traces measured (module docstring), with the task's median ``step_s``;
    ``warmed``: their warm-up steps are already left out."""
    traces = list(traces) if warmed else warm(traces)
    compute: dict[int, list[float]] = {}
    for t in traces:
        busy = sum(b - a for _, _, a, b in t.spans) if t.spans else t.compute_s
        if busy > 0:
            compute.setdefault(t.stage, []).append(busy / microbatches)
    by_key = {(t.step, t.stage, t.replica): t for t in traces}
    gaps: dict[int, list[float]] = {}
    sent: dict[int, dict[int, float]] = {}  # boundary -> step -> bytes forward
    for (step, stage, replica), t in by_key.items():
        n = t.sent.get((stage + 1, replica), 0)
        if n:
            per_step = sent.setdefault(stage, {})
            per_step[step] = per_step.get(step, 0.0) + n
        nxt = by_key.get((step, stage + 1, replica))
        if nxt is None:
            continue
        mine = {(op, mb): (a, b) for op, mb, a, b in t.spans}
        theirs = {(op, mb): (a, b) for op, mb, a, b in nxt.spans}
        found = [theirs[k][0] - mine[k][1] for k in mine if k[0] == "F" and k in theirs] + [
            mine[k][0] - theirs[k][1] for k in mine if k[0] == "B" and k in theirs
        ]
        positive = [g for g in found if g > 0]
        if positive:
            gaps.setdefault(stage, []).append(min(positive))
    boundaries = {
        b: (statistics.median(sent[b].values()) / microbatches, statistics.median(g))
        for b, g in gaps.items()
        if sent.get(b)
    }
    stage_s = {s: statistics.median(v) for s, v in compute.items()}
    return RunFigures(stage_s, boundaries, step_s, len({t.step for t in traces}))


POOL = 5  # tasks one fit pools: the task and up to this many less one earlier runs of its plan


def placement_key(plan: Plan) -> str:
    """What makes two runs' measurements comparable: the cluster, model and job, each stage's
    layers, datacenter and replicas' devices, and the reserved paths (their units set a shaped
    link's rate). Predictions and search figures are left out: a plan made on a refitted spec
    that places the job the same way runs the same thing."""
    return json.dumps(
        [
            plan.cluster,
            plan.model,
            plan.model_spec.model_dump(mode="json") if plan.model_spec else None,
            plan.job.model_dump(mode="json"),
            [
                [
                    st.chunks,
                    st.datacenter,
                    [[r.datacenter, r.nodes, r.devices] for r in st.replicas],
                ]
                for st in plan.stages
            ],
            [[p.after_stage, p.links, p.units, p.first_unit] for p in plan.paths],
        ],
        sort_keys=True,
    )


def earlier_tasks(db: Database, plan: Plan, task_id: int, limit: int) -> list[int]:
    """Up to ``limit`` tasks fitted before ``task_id``, newest first, of runs whose plan places
    the same job the same way on the same cluster (:func:`placement_key`): the runs a fit of
    ``plan`` can pool."""
    if limit <= 0:
        return []
    r = RecalibrationRecord
    with db.sessions() as s:
        q = select(r.task_id, r.run_id).where(
            r.cluster == plan.cluster, r.spec_json.is_not(None), r.task_id < task_id
        )
        rows = list(s.execute(q.order_by(r.task_id.desc())))
    key, keys, out = placement_key(plan), {}, []
    for task, run in rows:
        if run not in keys:
            earlier = run_plan(db, run)
            keys[run] = placement_key(earlier) if earlier is not None else None
        if keys[run] == key and task not in out:
            out.append(task)
            if len(out) == limit:
                break
    return out


def warm_steps(db: Database, task_id: int) -> list[float]:
    """The task's step times, warm-up left out as its median step leaves it out."""
    steps = [m.step_s for m in db.metrics(task_id)]
    return steps[len(steps) // 5 :] or steps


def task_words(task_id: int, pooled: Sequence[int]) -> str:
    """Which tasks a fit came from, in words."""
    if not pooled:
        return f"task {task_id}"
    return f"task {task_id} pooled with task{'s' * (len(pooled) > 1)} {', '.join(map(str, pooled))}"


def fit_task(
    db: Database,
    run_id: int,
    task_id: int,
    plan: Plan,
    cluster: ClusterSpec,
    step_s: float,
    pool: int = POOL,
) -> Fit:
    """The task's traces fitted to ``cluster`` (CannotFit says why not), pooled with those of
    up to ``pool - 1`` earlier tasks of the same placement (:func:`earlier_tasks`): their
    warm steps and spans taken together, so one slow or fast spell of this machine moves the
    fit by its share only. ``step_s`` is the task's median step; pooled, the step is the
    median of all the pooled tasks' warm steps."""
    traces = step_traces(db, task_id)
    if not traces:
        raise CannotFit(f"task {task_id} recorded no step traces")
    others = earlier_tasks(db, plan, task_id, pool - 1)
    pooled = warm(traces)
    steps = (warm_steps(db, task_id) or [step_s]) if others else []
    for n, task in enumerate(others, 1):
        # each task's steps moved apart from the others' (a step is keyed by its number)
        offset = n * 1_000_000
        pooled += [replace(t, step=t.step + offset) for t in warm(step_traces(db, task))]
        steps += warm_steps(db, task)
    pooled_step = statistics.median(steps) if steps else step_s
    figures = run_figures(pooled, plan.job.microbatches, pooled_step, warmed=True)
    routing = expert_imbalance(pooled) if plan.job.ep > 1 else None
    if routing is not None:  # priced at the routing measured, not taken up by the devices
        routing = min(max(routing, 1.0), plan.job.ep)
        job = plan.job.model_copy(update={"expert_imbalance": routing})
        plan = plan.model_copy(update={"job": job})
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"dmsc recalibration from run {run_id}, {task_words(task_id, others)} ({figures.steps} "
        f"steps measured, {when})"
    )
    fit = fit_run(plan, cluster, figures, source=source)
    return replace(fit, pooled=others, expert_imbalance=routing)


def record_fit(
    db: Database, run_id: int, task_id: int, cluster: str, fit: Fit | str
) -> RecalibrationRecord:
    """Keep the task's fit (or, a string, why there is none)."""
    if isinstance(fit, str):
        return db.add(
            RecalibrationRecord(run_id=run_id, task_id=task_id, cluster=cluster, reason=fit)
        )
    return db.add(
        RecalibrationRecord(
            run_id=run_id,
            task_id=task_id,
            cluster=cluster,
            spec_json=json.dumps(fit.cluster),
            fit_json=json.dumps(fit.as_json()),
            measured_step_s=fit.measured_step_s,
            predicted_before_s=fit.predicted_before_s,
            predicted_after_s=fit.predicted_after_s,
        )
    )


def run_plan(db: Database, run_id: int) -> Plan | None:
    """The plan run ``run_id`` deployed (None: no such run, or a plan this version cannot read)."""
    with db.sessions() as s:
        run = s.get(RunRecord, run_id)
        text = run.plan_json if run is not None else None
    if not text:
        return None
    try:
        return Plan.model_validate_json(text)
    except ValueError:
        return None


def run_exists(db: Database, run_id: int) -> bool:
    with db.sessions() as s:
        return s.get(RunRecord, run_id) is not None


def run_fits(db: Database, run_id: int) -> list[RecalibrationRecord]:
    """The run's recalibrations (fitted or not), newest first."""
    r = RecalibrationRecord
    with db.sessions() as s:
        q = select(r).where(r.run_id == run_id).order_by(r.id.desc())
        return list(s.scalars(q))


def newest_fit(db: Database, cluster: str) -> RecalibrationRecord | None:
    """The newest fitted recalibration of cluster ``cluster`` (by its name), if any."""
    r = RecalibrationRecord
    with db.sessions() as s:
        q = select(r).where(r.cluster == cluster, r.spec_json.is_not(None)).order_by(r.id.desc())
        return s.scalars(q.limit(1)).first()


def fitted_spec(record: RecalibrationRecord) -> dict[str, Any]:
    """The fitted cluster spec of ``record`` (a fitted one), as a spec file holds it."""
    assert record.spec_json is not None
    spec: dict[str, Any] = json.loads(record.spec_json)
    return spec
