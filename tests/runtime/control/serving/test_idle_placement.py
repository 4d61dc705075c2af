"""A serving replica goes to the idlest node: :meth:`ServingPool.node_load` reads the CPU % the
training steps' telemetry recorded in a real database (as ``record_step`` keeps it) and the
pool's picker (:func:`dmsc.planner.elastic.place_replica`) takes the node it says is idle."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dmsc.data.db import Database, TaskRecord
from dmsc.data.traces import record_step
from dmsc.planner.elastic import devices_in_use, place_replica
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.serving.elastic import ServingPool
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, resolve_model

MODEL = resolve_model("gpt-mini")


def _cluster() -> ClusterSpec:
    """One datacenter of three nodes of two CPU devices."""
    cpu = {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "memory_bw_gbyte_s": 10}
    host = {"device": "cpu", "devices": 2, "link": {"bandwidth_gbit_s": 40}}
    dc = {"name": "dc", "nodes": [{"type": "host", "count": 3}], "network": {"gbit_s_per_node": 10}}
    return ClusterSpec.model_validate(
        {"name": "hosts", "device_types": {"cpu": cpu}, "node_types": {"host": host},
         "datacenters": [dc]}
    )  # fmt: skip


def test_the_pool_places_a_replica_on_the_node_its_telemetry_says_is_idle(tmp_path: Path) -> None:
    cluster = _cluster()
    job = JobSpec(global_batch=8, micro_batch=2, pp=1, dp=1)
    plan = plan_job(cluster, MODEL, job, fixed=True).plan
    assert devices_in_use(plan) == {0}  # the one worker on node 0
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))
    assert isinstance(MODEL, TransformerSpec)
    pool = ServingPool(
        plan, MODEL, cluster, db, run.id, tmp_path, logging.getLogger("test"), lambda _: 0
    )
    assert pool.node_load() == {}  # nothing trained yet: packing fills node 0

    def placed() -> int:
        (rec,) = place_replica(plan, cluster, devices_in_use(plan), 1, pool.node_load()) or []
        return rec.devices[0] // 2

    assert placed() == 0
    task = db.add(TaskRecord(run_id=run.id, kind="train", state="done"))
    for step, cpu in enumerate([90.0, 96.0, 99.0]):  # the worker kept its node's core busy
        reply = {"traces": {(0, 0): ([], {})}, "telemetry": {(0, 0): {"cpu_percent": cpu}}}
        record_step(db, task.id, step, reply)
    assert pool.node_load() == {0: 95.0}
    assert placed() == 1  # an idle node, of two devices free
