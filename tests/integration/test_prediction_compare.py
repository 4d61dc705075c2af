"""A training task's reply compares its measured step with the prediction for the job that
ran (issue 29, point 5: `dmsc train --batch 32` was compared with the batch-16 prediction)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import MEASURED_CPU, control_plane

from dmsc.planner.solve import plan_job
from dmsc.runtime.compute.calibrate import calibrated_cluster
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration
LOCAL = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "local-cpu.yaml"
FIGURES = MEASURED_CPU


def test_a_task_of_another_batch_is_compared_with_its_own_prediction(tmp_path: Path) -> None:
    model = resolve_model("gpt-mini")
    cluster = ClusterSpec.model_validate(calibrated_cluster(load_spec(ClusterSpec, LOCAL), FIGURES))
    job = JobSpec(global_batch=4, micro_batch=2, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, model, job, fixed=True).plan
    with control_plane(plan, tmp_path) as cp:
        own = cp.train(TrainRequest(steps=1))
        assert own["predicted_step_s"] == plan.prediction.iteration_time_s
        assert own["prediction"] == "the plan's" and own["not_comparable"] is None
        cp.cluster = None  # the plan's cluster spec unknown: nothing to re-estimate on
        other = cp.train(TrainRequest(steps=1, batch=8))
        assert other["predicted_step_s"] is None
        assert other["not_comparable"].startswith("not comparable: the plan predicts batch 4")
        cp.cluster = cluster
        other = cp.train(TrainRequest(steps=1, batch=8))
    job8 = JobSpec.model_validate({**job.model_dump(), "global_batch": 8, "micro_batch": 4})
    want = plan_job(cluster, model, job8, fixed=True).plan.prediction.iteration_time_s
    assert other["predicted_step_s"] == want > plan.prediction.iteration_time_s
    assert other["prediction"].startswith("re-estimated for batch 8 in 2 micro-batches at dp 1")
