"""A training task that changes the data-parallel degree: the deployment is re-planned, resized
from a checkpoint, and trains on as if it had never changed (against a run that did not)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import control_plane, one_box

from dmsc.planner.solve import plan_job
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration


def _losses(cp, tasks: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    return [m.loss for t in tasks for m in cp.db.metrics(t)]


def test_growing_and_shrinking_dp_between_tasks_trains_as_without(tmp_path: Path) -> None:
    cluster = load_spec(ClusterSpec, one_box(tmp_path, 4))
    job = JobSpec(global_batch=8, micro_batch=2, pp=2, dp=1)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with control_plane(plan, tmp_path / "a") as cp:
        want = _losses(cp, [cp.train(TrainRequest(steps=6))["task"]])
    with control_plane(plan, tmp_path / "b") as cp:
        with pytest.raises(BadRequest, match="cluster spec"):
            cp.train_params(TrainRequest(steps=2, dp=2))  # no cluster given to this plane
        cp.cluster = cluster
        with pytest.raises(BadRequest, match="do not fit"):
            # 8 devices for 4 two-stage replicas
            cp.train_params(TrainRequest(steps=2, dp=4, microbatches=2))
        tasks = [cp.train(TrainRequest(steps=2))["task"]]
        tasks.append(cp.train(TrainRequest(steps=2, dp=2))["task"])
        assert cp.deployment.layout.replicas == 2 and len(cp.deployment.handles) == 4
        assert cp.inference.names() == ["replica-0", "replica-1"]
        tasks.append(cp.train(TrainRequest(steps=2, dp=1))["task"])
        assert cp.plan.job.dp == 1 and len(cp.deployment.handles) == 2
        got = _losses(cp, tasks)
        events = [(e.action, e.replicas_after) for e in cp.db.scale_events(cp.run.id)]
    assert events == [("train-dp", 2), ("train-dp", 1)]
    assert len(got) == len(want) == 6
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (got, want)
