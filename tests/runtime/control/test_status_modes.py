"""``dmsc status``'s section per parallel mode: the plan's prediction against the traces, in the
Status reply, the task's result, the dashboard's document and the printed table."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from dmsc.cli.mode_table import print_modes
from dmsc.data.db import Database
from dmsc.data.traces import add_step_traces
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control import status
from dmsc.runtime.control.advisors.prediction import Prediction
from dmsc.runtime.control.dashboard_state import tenant_rows
from dmsc.runtime.transport.replies import StatusReply
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[3]


class _Report:
    def as_json(self) -> dict[str, object]:
        return {"steps": 2}


def _run_of_one_task(tmp_path: Path) -> tuple[Plan, Database, int, int]:
    """A pp = 2 x dp = 2 plan of gpt-mini on two sites, and a run with one training task."""
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    job = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")
    run = db.new_run("gpt-mini", "two-sites-cpu", {}).id
    return plan, db, run, db.new_task(run, "train", {}, state="done").id


def test_the_plan_against_the_traces_per_mode(tmp_path: Path) -> None:
    plan, db, run, task = _run_of_one_task(tmp_path)
    assert status.modes(db, plan, None) == []
    for step in range(2):
        traces = {(0, 0): ([], {"1/0": 1000, "0/1": 40}), (0, 1): ([], {"0/0": 40})}
        comm = {
            (0, 0): {"pp": {"s": 0.25, "bytes": 1000}, "dp": {"s": 0.5, "bytes": 40}},
            (0, 1): {"dp": {"s": 0.125, "bytes": 40}},
        }
        add_step_traces(db, task, step, traces, {}, comm=comm)
    rows = {r["mode"]: r for r in status.modes(db, plan, task)}
    b = plan.prediction.breakdown_s
    assert rows["dp"]["predicted_s"] == b["dp_comm"] and rows["dp"]["measured_s"] == 0.125
    assert rows["dp"]["slowest_s"] == 0.5  # replica 0 also waited for replica 1's backward
    assert rows["dp"]["measured_bytes"] == 80 and rows["dp"]["steps"] == 2
    assert rows["pp"]["predicted_s"] == b["pp_comm"] + b["bubble"]
    assert rows["pp"]["ratio"] == 0.25 / (b["pp_comm"] + b["bubble"])
    assert status.result_of(_Report(), db, plan, task) == {"steps": 2, "modes": list(rows.values())}
    assert tenant_rows(db, plan, run, None)["training"]["modes"] == list(rows.values())
    assert "routing" not in tenant_rows(db, plan, run, None)["training"]  # no mixture
    reply = StatusReply(
        run=run, model="gpt-mini", steps=2, epoch=0, services=[], tasks=[], faults=[],
        replicas_down=[], spares=[], modes_task=task, modes=list(rows.values()),
    )  # fmt: skip
    buf = io.StringIO()
    print_modes(Console(file=buf, width=200, force_terminal=False), reply)
    text = buf.getvalue()
    assert f"(task {task})" in text and "data parallel (exposed all-reduce)" in text
    assert "125.0 ms" in text and "500.0 ms" in text  # dp's exposure, its slowest worker's
    assert "1.00 KB" in text  # pp's 1000 bytes a step


def test_a_task_of_another_job_is_compared_per_mode_with_its_own_prediction(
    tmp_path: Path,
) -> None:
    """A task that ran another batch, dp or sync than the plan's had its measured communication
    per mode set beside the plan's figures, which are another job's."""
    plan, db, run, task = _run_of_one_task(tmp_path)
    comm = {(0, 0): {"dp": {"s": 0.5, "bytes": 40}}}
    add_step_traces(db, task, 0, {(0, 0): ([], {})}, {}, comm=comm)
    # not comparable (its dp changed while it ran): no figure per mode
    other = "not comparable: the task ran at dp 2 -> 1; each segment has its own prediction"
    rows = status.modes(db, plan, task, Prediction(None, other))
    assert [(r["mode"], r["predicted_s"], r["measured_s"]) for r in rows] == [("dp", None, 0.5)]
    result = status.result_of(_Report(), db, plan, task, Prediction(None, other))
    assert result["modes"][0]["predicted_s"] is None and result["modes"][0]["ratio"] is None
    # re-estimated for the job it ran: that job's figures
    again = Prediction(0.3, "re-estimated for batch 32", {"dp_comm": 0.25, "pp_comm": 0.0})
    assert status.modes(db, plan, task, again)[0]["predicted_s"] == 0.25
    assert status.result_of(_Report(), db, plan, task, again)["modes"][0]["ratio"] == 2.0
    # the plan's own job keeps the plan's figures
    assert status.modes(db, plan, task)[0]["predicted_s"] == plan.prediction.breakdown_s["dp_comm"]
    # and the printed table says what its predicted column is
    for basis, words in [
        (other, "predicted: none, the task's step is not comparable: the task ran at dp 2"),
        (again.basis, "predicted: the cost model's, re-estimated for batch 32;"),
    ]:
        reply = StatusReply(
            run=run, model="gpt-mini", steps=1, epoch=0, services=[], tasks=[], faults=[],
            replicas_down=[], spares=[], modes_task=task, modes=rows, modes_prediction=basis,
        )  # fmt: skip
        buf = io.StringIO()
        print_modes(Console(file=buf, width=200, force_terminal=False), reply)
        assert words in " ".join(buf.getvalue().split())


def test_the_routings_measured_imbalance_is_shown_beside_the_one_the_plan_priced(
    tmp_path: Path,
) -> None:
    """An expert-parallel task's traces count each mixture's routed and received tokens: the
    task's result and ``dmsc status`` show the busiest rank's share (here 1.4 of an even one)
    beside the plan's ``expert_imbalance``; a task without mixtures shows none."""
    plan, db, run, task = _run_of_one_task(tmp_path)
    assert status.routing(db, task) is None
    for step in range(2):
        comm = {
            (0, 0): {"ep": {"s": 0.01, "routed": 100, "received": 140}},
            (0, 1): {"ep": {"s": 0.01, "routed": 100, "received": 60}},
        }
        add_step_traces(db, task, step, {(0, 0): ([], {}), (0, 1): ([], {})}, {}, comm=comm)
    assert status.routing(db, task) == 1.4
    got = status.result_of(_Report(), db, plan, task)["expert_imbalance"]
    assert got == {"measured": 1.4, "planned": 1.0}
    # the dashboard's document too (the charts page prints it under the modes)
    assert tenant_rows(db, plan, run, None)["training"]["routing"] == got
    reply = StatusReply(
        run=run, model="gpt-mini", steps=2, epoch=0, services=[], tasks=[], faults=[],
        replicas_down=[], spares=[], modes_task=task, modes=status.modes(db, plan, task),
        expert_imbalance=1.4,
    )  # fmt: skip
    buf = io.StringIO()
    print_modes(Console(file=buf, width=200, force_terminal=False), reply)
    assert "received 1.40 of an even share" in buf.getvalue()
    assert "priced 1.00" in buf.getvalue()


def test_an_ended_mixtures_task_is_compared_at_the_routing_its_traces_measured(
    tmp_path: Path,
) -> None:
    """status.finished, what the control plane stores as a task's result: the step compared
    with the prediction at the routing the task measured (1.4 here), not the plan's even one."""
    from dataclasses import dataclass

    from runtime_helpers import MEASURED_CPU

    from dmsc.runtime.compute.calibrate import calibrated_cluster
    from dmsc.runtime.control.training.params import TrainParams
    from dmsc.runtime.control.training.report import TrainReport
    from dmsc.spec import TransformerSpec

    template = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    cluster = ClusterSpec.model_validate(calibrated_cluster(template, MEASURED_CPU))
    moe = resolve_model("moe-mini")
    assert isinstance(moe, TransformerSpec)
    job = JobSpec(global_batch=8, micro_batch=4, dp=2, ep=2)
    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")

    @dataclass
    class Plane:
        db: Database
        plan: Plan
        cluster: ClusterSpec | None
        model: TransformerSpec

    plane = Plane(db, plan_job(cluster, moe, job, fixed=True).plan, cluster, moe)
    run = db.new_run("moe-mini", "two-sites-cpu", {}).id
    task = db.new_task(run, "train", {}, state="done").id
    for step in range(2):
        comm = {
            (0, 0): {"ep": {"s": 0.01, "routed": 100, "received": 140}},
            (0, 1): {"ep": {"s": 0.01, "routed": 100, "received": 60}},
        }
        add_step_traces(db, task, step, {(0, 0): ([], {}), (0, 1): ([], {})}, {}, comm=comm)
    params = TrainParams(steps=2, batch=8, microbatches=1, checkpoint_every=0,
                         late_policy="wait", grad_wait_s=1.0)  # fmt: skip
    report = TrainReport(2, first_step=0)
    report.segment(0, 2, plane.plan)
    report.timed(0.1)
    got = status.finished(plane, report, params, task)
    assert "routing 1.40 of an even share" in got["prediction"]
    assert got["predicted_step_s"] > plane.plan.prediction.iteration_time_s
    assert got["expert_imbalance"] == {"measured": 1.4, "planned": 1.0}
