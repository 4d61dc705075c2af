"""``dmsc calibrate --from-run RUN`` and ``dmsc plan --calibrated``: the cluster spec refitted to
what a run measured (:mod:`dmsc.data.calibrations`: the control plane fits every training task
when it ends), written out, or planned on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.data.calibration_records import RecalibrationRecord
    from dmsc.planner.plan import Plan
    from dmsc.spec import ClusterSpec


def default_out(cluster: str) -> Path:
    from dmsc.data.db import data_dir

    return data_dir() / f"{cluster}.recalibrated.yaml"


def run_fit(run_id: int) -> tuple[RecalibrationRecord, str]:
    """The run's newest fit and the database it is in; a SpecError naming ``--from-run`` when
    there is no such run, it traced no step, or none of its tasks could be fitted (why not)."""
    from dmsc.cli.database import open_database
    from dmsc.data.calibrations import run_exists, run_fits
    from dmsc.data.traces import traced_tasks

    db = open_database()
    where = db.url.removeprefix("sqlite:///")
    if not run_exists(db, run_id):
        raise SpecError(where, "--from-run", f"no run {run_id} in this database")
    if not traced_tasks(db, run_id):
        raise SpecError(
            where, "--from-run", f"run {run_id} has no step traces (no training task ran in it)"
        )
    fits = run_fits(db, run_id)
    fitted = [r for r in fits if r.spec_json is not None]
    if not fitted:
        why = fits[0].reason if fits else "its tasks ended before recalibration was kept"
        raise SpecError(where, "--from-run", f"run {run_id} was not recalibrated: {why}")
    return fitted[0], where


def describe(record: RecalibrationRecord) -> str:
    """What a fit is, in words: its run and task, the step measured and both predictions."""
    fit: dict[str, Any] = json.loads(record.fit_json)
    measured, before, after = (
        record.measured_step_s or 0.0,
        record.predicted_before_s or 0.0,
        record.predicted_after_s or 0.0,
    )
    speeds = ", ".join(f"{k} x{v:.3f}" for k, v in fit.get("device_speed", {}).items())
    links = ", ".join(f"{k} x{v:.3f}" for k, v in fit.get("link_scale", {}).items())
    from dmsc.data.calibrations import task_words

    tasks = task_words(record.task_id, fit.get("pooled") or [])
    return (
        f"run {record.run_id}, {tasks} ({fit.get('steps', 0)} steps): step "
        f"{measured * 1e3:.1f} ms measured, predicted {before * 1e3:.1f} ms before and "
        f"{after * 1e3:.1f} ms after; devices {speeds or 'unchanged'}, links "
        f"{links or 'unchanged'} (step factor {fit.get('step_factor', 1.0):.3f} over the "
        "stages' spans)"
    )


def write_from_run(run_id: int, out: str | None, console: Console) -> Path:
    """``dmsc calibrate --from-run``: the run's newest fitted spec written to ``out`` (default
    ``$DMSC_HOME/CLUSTER.recalibrated.yaml``)."""
    import yaml

    from dmsc.data.calibrations import fitted_spec

    record, _ = run_fit(run_id)
    dst = Path(out) if out else default_out(record.cluster)
    dst.write_text(
        f"# Written by `dmsc calibrate --from-run {run_id}`: cluster {record.cluster} refitted "
        f"to task {record.task_id}'s step traces.\n"
        + yaml.safe_dump(fitted_spec(record), sort_keys=False)
    )
    console.print(f"wrote {dst}: {describe(record)}", highlight=False, soft_wrap=True)
    return dst


def calibrated(
    cluster: ClusterSpec, where: str
) -> tuple[ClusterSpec, str, Plan | None, float | None]:
    """``dmsc plan --calibrated``: the newest recalibration of ``cluster`` (by its name), the
    words that say which, the plan of the run it was fitted to (None if that run's plan no
    longer reads) and the routing's imbalance that run measured (None: no expert parallelism;
    the fit priced it, :func:`dmsc.data.calibrations.fit_task`); a SpecError naming
    ``--calibrated`` when there is none."""
    from dmsc.cli.database import open_database
    from dmsc.data.calibrations import fitted_spec, newest_fit, run_plan
    from dmsc.spec import ClusterSpec

    db = open_database()
    record = newest_fit(db, cluster.name)
    if record is None:
        raise SpecError(
            where,
            "--calibrated",
            f"no recalibration of cluster {cluster.name!r} in {db.url.removeprefix('sqlite:///')}"
            " (a training task on a plan of it makes one)",
        )
    spec = ClusterSpec.model_validate(fitted_spec(record))
    words = f"planning on cluster {cluster.name!r} as recalibrated from {describe(record)}"
    routing = json.loads(record.fit_json or "{}").get("expert_imbalance")
    return spec, words, run_plan(db, record.run_id), routing
