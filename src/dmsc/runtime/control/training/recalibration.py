"""After a training task: its measured stage compute and link transfers refit the cluster spec
its plan was made for, kept in the database with the run (:mod:`dmsc.data.calibrations`; the
fit itself is :mod:`dmsc.planner.recalibrate`). ``dmsc calibrate --from-run RUN`` writes the
fitted spec, ``dmsc plan --calibrated`` plans on the newest one of a cluster.

A task is fitted when it ran the plan's job (its batch, micro-batches and dp: another job's
traces say nothing about the plan's prediction) on a known cluster spec of the plan's cluster;
else the row says why not. A fit never fails the task: what goes wrong is logged and kept as
the row's reason.
"""

from __future__ import annotations

import logging

from dmsc.data.calibration_records import RecalibrationRecord
from dmsc.data.calibrations import fit_task, record_fit
from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.report import TrainReport
from dmsc.spec import ClusterSpec


def why_not(
    plan: Plan, cluster: ClusterSpec | None, params: TrainParams, report: TrainReport
) -> str | None:
    """Why the task cannot refit ``cluster`` (None when it can)."""
    job = plan.job
    if cluster is None:
        return (
            f"the control plane has no spec of cluster {plan.cluster!r} (dmsc up --cluster "
            "PATH gives it)"
        )
    if cluster.name != plan.cluster:
        return f"the plan was made for cluster {plan.cluster!r}, the spec given is {cluster.name!r}"
    ran = (params.batch, params.microbatches, params.dp or job.dp)
    if ran != (job.global_batch, job.microbatches, job.dp):
        return (
            f"the task ran batch {ran[0]} in {ran[1]} micro-batches at dp {ran[2]}, the plan "
            f"predicts batch {job.global_batch} in {job.microbatches} at dp {job.dp}"
        )
    if not report.step_s:
        return "the task timed no step"
    return None


def after_task(
    db: Database,
    run_id: int,
    task_id: int,
    plan: Plan,
    cluster: ClusterSpec | None,
    params: TrainParams,
    report: TrainReport,
    log: logging.Logger,
) -> RecalibrationRecord | None:
    """Fit the task's traces to ``cluster`` and keep the fit, or why there is none (None when
    even that could not be written: logged)."""
    extra = {"task_id": task_id, "run": run_id}
    try:
        why = why_not(plan, cluster, params, report)
        if why is None:
            assert cluster is not None
            try:
                fit = fit_task(db, run_id, task_id, plan, cluster, report.median_step_s)
            except ValueError as exc:  # CannotFit, or a spec the fit made that does not hold
                why = f"not fitted: {exc}"
            else:
                log.info(
                    "recalibrated cluster %s: step %.1f ms measured, %.1f ms predicted before, "
                    "%.1f ms after",
                    plan.cluster,
                    fit.measured_step_s * 1e3,
                    fit.predicted_before_s * 1e3,
                    fit.predicted_after_s * 1e3,
                    extra=extra,
                )
                return record_fit(db, run_id, task_id, plan.cluster, fit)
        log.info("not recalibrated: %s", why, extra=extra)
        return record_fit(db, run_id, task_id, plan.cluster, why)
    except Exception as exc:  # the task has ended well: a fit must not fail it
        log.warning("recalibration failed: %s", exc, extra=extra)
        return None
