"""Elastic serving replicas on real workers: placed on free devices, loaded with the model the
deployment serves, drained before they stop, every change recorded."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import control_plane, one_box

from dmsc.planner.solve import plan_job
from dmsc.runtime.control.serving.elastic import ServingPool
from dmsc.runtime.transport.messages import Sampling, TrainRequest
from dmsc.runtime.transport.rpc import NoRoom
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration


def test_a_serving_replica_serves_the_same_model_and_is_drained_before_it_stops(
    tmp_path: Path,
) -> None:
    cluster = load_spec(ClusterSpec, one_box(tmp_path, 4))  # the plan takes 2 of the 4 devices
    plan = plan_job(
        cluster, resolve_model("gpt-mini"), JobSpec(global_batch=8, micro_batch=2, pp=2), fixed=True
    ).plan
    with control_plane(plan, tmp_path) as cp:
        cp.train(TrainRequest(steps=2))  # a production version: what serving replicas load
        cp.inference.sync_versions()
        pool = ServingPool(
            plan, cp.model, cluster, cp.db, cp.run.id, cp.home, cp.log, cp.inference.in_flight
        )
        cp.inference.pool = pool
        try:
            name = pool.scale_out("test", 3.0)
            assert name == "serve-1" and cp.inference.names() == ["replica-0", "serve-1"]
            assert {d for r in pool.replicas[name].placement for d in r.devices} == {2, 3}
            greedy = Sampling(temperature=0.0, seed=1)
            ours = cp.inference.infer_on("replica-0", "def ", 12, sampling=greedy)
            assert cp.inference.infer_on(name, "def ", 12, sampling=greedy) == ours
            # no room for a third pipeline: refused, and said so
            assert pool.scale_out("test", 9.0) is None
            # drained: a request under way when the replica is removed still gets its answer
            answer: list[str] = []
            ids: list[int] = []
            long = threading.Thread(
                target=lambda: answer.append(
                    cp.inference.infer_on(name, "def ", 60, sampling=greedy, ids=ids)
                )
            )
            long.start()
            while cp.inference.in_flight(name) == 0:
                time.sleep(0.001)
            pids = [h.process.pid for h in pool.replicas[name].dep.handles]
            pool.scale_in(name, "test")
            long.join(timeout=60)
            assert len(answer) == 1 and len(ids) == 60  # every token, though it was removed
            assert cp.inference.names() == ["replica-0"]
            with pytest.raises(NoRoom, match="does not serve any more"):
                cp.inference.infer_on(name, "def ", 2)
            for pid in pids:
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)
            events = [
                (e.action, e.replica, e.replicas_after) for e in cp.db.scale_events(cp.run.id)
            ]
            assert events == [
                ("out", "serve-1", 2),
                ("refused", "serve-2", 2),
                ("in", "serve-1", 1),
            ]
            assert "drained" in cp.db.scale_events(cp.run.id)[-1].reason
        finally:
            pool.shutdown()
