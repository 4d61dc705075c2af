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
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select

from dmsc.data.calibration_records import RecalibrationRecord
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


def run_figures(traces: Sequence[StepTrace], microbatches: int, step_s: float) -> RunFigures:
    """What the traces measured (module docstring), with the task's median ``step_s``."""
    traces = warm(traces)
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


def fit_task(
    db: Database, run_id: int, task_id: int, plan: Plan, cluster: ClusterSpec, step_s: float
) -> Fit:
    """The task's traces fitted to ``cluster`` (CannotFit says why not)."""
    traces = step_traces(db, task_id)
    if not traces:
        raise CannotFit(f"task {task_id} recorded no step traces")
    figures = run_figures(traces, plan.job.microbatches, step_s)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"dmsc recalibration from run {run_id}, task {task_id} ({figures.steps} steps "
        f"measured, {when})"
    )
    return fit_run(plan, cluster, figures, source=source)


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
