"""The dashboard's document from a plan and a database: topology, traffic and the Gantt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime_helpers import MEASURED_CPU

from dmsc.data.db import Database
from dmsc.data.traces import add_step_traces
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.compute.calibrate import calibrated_cluster
from dmsc.runtime.control.advisors.prediction import (
    Prediction,
    TaskPredictions,
    predict_segments,
    prediction_for,
    task_prediction,
)
from dmsc.runtime.control.dashboard_state import tenant_rows, topology, traffic, training
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.control.training.resize import resized_plan
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[3]


def _plan():  # type: ignore[no-untyped-def]
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    job = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)
    return plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan


def test_topology_places_every_stage_replica_in_its_datacenter() -> None:
    plan = _plan()
    topo = topology(plan)
    placed = {
        (p["stage"], p["replica"]): dc["name"] for dc in topo["datacenters"] for p in dc["placed"]
    }
    assert placed == {
        (st.index, r.dp_rank): r.datacenter for st in plan.stages for r in st.replicas
    }
    assert [p["after_stage"] for p in topo["paths"]] == [p.after_stage for p in plan.paths]
    assert all(p["reserved"].startswith("units ") for p in topo["paths"])


def test_traffic_and_gantt_come_from_the_traces(tmp_path: Path) -> None:
    plan = _plan()
    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")
    task = db.new_task(db.new_run("gpt-mini", "two-sites-cpu", {}).id, "train", {}).id
    for step in range(3):
        db.add_metric(task, step, 3.0 - step, 0.5, 1000.0)
        add_step_traces(
            db,
            task,
            step,
            {
                (0, 0): ([("F", 0, 10.0 + step, 10.1 + step)], {"1/0": 1000}),
                (1, 0): ([("F", 0, 10.2 + step, 10.3 + step)], {"0/0": 500}),
            },
            {},
        )
    links, gantt = traffic(db, plan, task)
    by_pair = {(link["from"], link["to"]): link for link in links}
    assert by_pair[("0/0", "1/0")]["bytes_per_step"] == 1000
    assert by_pair[("0/0", "1/0")]["mbit_s"] == 1000 * 8 / 0.5 / 1e6
    assert by_pair[("0/0", "1/0")]["kind"] == "pipeline"
    assert {g["step"] for g in gantt} == {1, 2}  # the last two steps
    first = min(gantt, key=lambda g: g["t0_ms"])
    assert first["t0_ms"] == 0 and abs(first["t1_ms"] - 100) < 1e-6
    assert training(db, task, Prediction(0.4, "the plan's"))["loss"] == [3.0, 2.0, 1.0]
    assert traffic(db, plan, None) == ([], [])


def test_a_task_started_in_the_same_instant_it_was_made_waited_zero_not_less() -> None:
    """The database stamps created_at when the row is built and started_at a moment earlier or
    later (two clocks reads); the page showed -0.01 s of queue wait."""
    import datetime as dt

    from dmsc.data.db import TaskRecord
    from dmsc.runtime.control.dashboard_state import _task

    made = dt.datetime(2026, 1, 1, 12, 0, 0, 10_000)
    task = TaskRecord(id=1, kind="train", state="done", lane="sync", priority=0, tenant="t")
    task.created_at, task.started_at, task.attempts = made, made - dt.timedelta(milliseconds=10), 0
    assert _task(task)["queue_wait_s"] == 0.0
    task.started_at = made + dt.timedelta(seconds=2)
    assert _task(task)["queue_wait_s"] == 2.0


def test_the_step_chart_shows_the_prediction_for_the_job_the_task_ran(tmp_path: Path) -> None:
    """Issue 29, item 5: a task of batch 32 on a batch-16 plan was drawn beside the plan's
    batch-16 prediction; the line is the prediction for the job that ran (re-estimated), and
    none, with the reason, where nothing can be compared."""
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    measured = ClusterSpec.model_validate(calibrated_cluster(cluster, MEASURED_CPU))
    plan = plan_job(
        measured,
        resolve_model("gpt-mini"),
        JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2),
        fixed=True,
    ).plan
    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")
    run = db.new_run("gpt-mini", "two-sites-cpu", {}).id
    task = db.new_task(run, "train", {"batch": 32}, state="done")
    db.add_metric(task.id, 0, 3.0, 0.5, 1000.0)
    model = resolve_model("gpt-mini")

    def predict(t):  # type: ignore[no-untyped-def]
        return task_prediction(plan, measured, model, {"batch": 32})

    shown = tenant_rows(db, plan, run, None, predict=predict)["training"]
    want = task_prediction(plan, measured, model, {"batch": 32})
    assert want.step_s is not None and want.step_s > 1.5 * plan.prediction.iteration_time_s
    assert shown["predicted_step_s"] == want.step_s
    assert shown["prediction"].startswith("re-estimated for batch 32")
    guessed = tenant_rows(
        db, plan, run, None, predict=lambda t: task_prediction(plan, cluster, model, {})
    )["training"]
    assert guessed["predicted_step_s"] is None and "never measured" in guessed["prediction"]


def _plans_before_and_after_a_shrink() -> tuple[ClusterSpec, Any, Plan, Plan]:
    """The calibrated two-site cluster, gpt-mini, its pp 2 x dp 2 plan and that plan cut to
    dp 1 (what a shrink re-plans)."""
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    measured = ClusterSpec.model_validate(calibrated_cluster(cluster, MEASURED_CPU))
    model = resolve_model("gpt-mini")
    plan = plan_job(measured, model, JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2),
                    fixed=True).plan  # fmt: skip
    return measured, model, plan, resized_plan(plan, model, measured, 1)


def test_a_task_that_changed_dp_is_drawn_beside_each_dps_prediction(tmp_path: Path) -> None:
    """Issue 32: a task that shrank from dp 2 to dp 1 between two steps was drawn beside the
    prediction for the job in its parameters; the chart now has each segment's own prediction
    over its steps (the task's result, as the session reported it), and none task-wide."""
    measured, model, plan, shrunk = _plans_before_and_after_a_shrink()
    params = TrainParams(steps=6, batch=16, microbatches=4, checkpoint_every=0,
                         late_policy="wait", grad_wait_s=1.0)  # fmt: skip
    report = TrainReport(6, first_step=10)
    report.segment(10, 2, plan)
    for dt in (0.30, 0.31, 0.29):
        report.timed(dt)
    report.segment(13, 1, shrunk)  # the loop's shrink before step 13
    for dt in (0.50, 0.52):
        report.timed(dt)
    predict_segments(report, shrunk, measured, model, params)
    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")
    run = db.new_run("gpt-mini", "two-sites-cpu", {}).id
    task = db.new_task(run, "train", params.as_json(), state="done").id
    for step, dt in zip(range(10, 15), (0.30, 0.31, 0.29, 0.50, 0.52), strict=True):
        db.add_metric(task, step, 3.0, dt, 1000.0)
    db.set_task_result(task, report.as_json())
    asked = []
    shown = tenant_rows(db, plan, run, None, predict=lambda t: asked.append(t) or Prediction(
        0.1, "the plan's"))["training"]  # fmt: skip
    assert asked == []  # not the task-wide prediction of the job in its parameters
    assert shown["predicted_step_s"] is None
    assert shown["prediction"].startswith("not comparable: the task ran at dp 2 -> 1")
    first, second = shown["segments"]
    assert (first["first_step"], first["last_step"], first["dp"], first["steps"]) == (10, 12, 2, 3)
    assert (second["first_step"], second["last_step"], second["dp"]) == (13, 14, 1)
    assert first["median_step_s"] == 0.30 and second["median_step_s"] == 0.52
    for seg, on, dp in ((first, plan, 2), (second, shrunk, 1)):
        want = prediction_for(on, measured, model, 16, 4, dp)
        assert want.step_s is not None and seg["predicted_step_s"] == want.step_s
    assert first["predicted_step_s"] != second["predicted_step_s"]
    # a task that ran at one dp has no segments: the task-wide prediction, as before
    one = db.new_task(run, "train", params.as_json(), state="done").id
    db.add_metric(one, 15, 3.0, 0.3, 1000.0)
    kept = TrainReport(1, first_step=15)
    kept.segment(15, 2, plan)
    kept.timed(0.3)
    db.set_task_result(one, kept.as_json())
    shown = tenant_rows(db, plan, run, None, predict=lambda t: Prediction(0.1, "the plan's"))
    assert shown["training"]["segments"] == [] and shown["training"]["predicted_step_s"] == 0.1


def test_a_running_task_that_changed_dp_is_drawn_beside_each_dps_prediction_so_far(
    tmp_path: Path,
) -> None:
    """Issue 32: the segments appeared only once the task ended (its result). While it runs,
    the dashboard reads its session's report (the control plane's TaskPredictions, which the
    session hands it to): each segment so far beside the prediction for its dp on the plan it
    ran on, a step timed meanwhile counted at the next read, and none task-wide."""
    measured, model, plan, shrunk = _plans_before_and_after_a_shrink()
    params = TrainParams(steps=8, batch=16, microbatches=4, checkpoint_every=0,
                         late_policy="wait", grad_wait_s=1.0)  # fmt: skip
    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")
    run = db.new_run("gpt-mini", "two-sites-cpu", {}).id
    task = db.new_task(run, "train", params.as_json(), state="running").id
    predictions = TaskPredictions()
    report = TrainReport(8, first_step=10)
    predictions.begin(task, params, report)  # what the session does as it makes its report
    report.segment(10, 2, plan)
    for step, dt in zip(range(10, 13), (0.30, 0.31, 0.29), strict=True):
        report.timed(dt)
        db.add_metric(task, step, 3.0, dt, 1000.0)
    asked: list[object] = []

    def shown() -> dict[str, Any]:
        def live(t: int) -> list[dict[str, Any]] | None:
            return predictions.segments(t, shrunk, measured, model)

        def predict(t: object) -> Prediction:
            asked.append(t)
            return Prediction(0.1, "the plan's")

        return tenant_rows(db, shrunk, run, None, predict=predict, live=live)["training"]

    assert shown()["segments"] == [] and asked  # one dp so far: the task-wide prediction
    report.segment(13, 1, shrunk)  # the loop's shrink before step 13
    report.timed(0.50)
    db.add_metric(task, 13, 3.0, 0.50, 1000.0)
    asked.clear()
    now = shown()
    assert asked == [] and now["predicted_step_s"] is None
    assert now["prediction"].startswith("not comparable: the task runs at dp 2 -> 1 so far")
    first, second = now["segments"]
    assert (first["first_step"], first["last_step"], first["dp"], first["steps"]) == (10, 12, 2, 3)
    assert (second["first_step"], second["last_step"], second["dp"], second["steps"]) == (
        13, 13, 1, 1)  # fmt: skip
    assert first["median_step_s"] == 0.30 and second["median_step_s"] == 0.50
    for seg, on, dp in ((first, plan, 2), (second, shrunk, 1)):
        want = prediction_for(on, measured, model, 16, 4, dp)
        assert want.step_s is not None and seg["predicted_step_s"] == want.step_s
    report.timed(0.54)  # the next step
    db.add_metric(task, 14, 3.0, 0.54, 1000.0)
    second = shown()["segments"][1]
    assert (second["last_step"], second["steps"], second["median_step_s"]) == (14, 2, 0.54)
    # once the task ends its result's segments are drawn, as before
    predict_segments(report, shrunk, measured, model, params)
    db.set_task_result(task, report.as_json())
    db.set_task_state(task, "done")
    ended = shown()
    assert ended["segments"] == [now["segments"][0], second]
    assert ended["prediction"].startswith("not comparable: the task ran at dp 2 -> 1")
