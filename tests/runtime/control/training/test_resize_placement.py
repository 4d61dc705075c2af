"""A resize's re-plan told what the workers measured puts a grow's new replicas on the idlest
nodes (training.resize.resized_plan -> planner.elastic.place_grown), and the control plane reads
that load from the newest training task's step traces (data.traces.latest_worker_cpu)."""

from __future__ import annotations

from pathlib import Path

from conftest import three_cpu_hosts

from dmsc.data.db import Database
from dmsc.data.traces import add_step_traces, latest_worker_cpu
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.training.resize import resized_plan
from dmsc.spec import JobSpec, resolve_model

MODEL = resolve_model("gpt-mini")


def test_a_grow_told_the_load_avoids_the_busy_node(tmp_path: Path) -> None:
    cluster = three_cpu_hosts()
    plan = plan_job(cluster, MODEL, JobSpec(global_batch=12, micro_batch=2, pp=1), fixed=True).plan
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run(plan.model, plan.cluster, {})
    old = db.new_task(run.id, "train", {}, state="done").id
    new = db.new_task(run.id, "train", {}, state="done").id
    add_step_traces(db, old, 0, {(0, 0): ([], {})}, {}, {(0, 0): {"cpu_percent": 10.0}})
    for step, cpu in enumerate((280.0, 320.0)):
        add_step_traces(db, new, step, {(0, 0): ([], {})}, {}, {(0, 0): {"cpu_percent": cpu}})
    db.new_task(run.id, "train", {}, state="queued")  # nothing measured yet: not the newest
    cpu = latest_worker_cpu(db, run.id)
    assert cpu == {(0, 0): 300.0}
    blind = resized_plan(plan, MODEL, cluster, 3)
    grown = resized_plan(plan, MODEL, cluster, 3, worker_cpu=cpu)
    assert [r.nodes for r in blind.stages[0].replicas] == [[0], [0], [1]]
    assert [r.nodes for r in grown.stages[0].replicas] == [[0], [1], [2]]
