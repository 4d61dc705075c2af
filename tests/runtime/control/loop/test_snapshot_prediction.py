"""The control loop compares a mixture's task with the prediction at the routing its traces
measured, not at the plan's (advisors.prediction.routed)."""

from __future__ import annotations

from pathlib import Path

from runtime_helpers import MEASURED_CPU

from dmsc.data.traces import StepTrace
from dmsc.planner.solve import plan_job
from dmsc.runtime.compute.calibrate import calibrated_cluster
from dmsc.runtime.control.advisors.base import Measurements
from dmsc.runtime.control.loop.snapshot import Predictions
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

CLUSTER = Path(__file__).resolve().parents[4] / "examples" / "clusters" / "two-sites-cpu.yaml"


def _traces(received: tuple[int, int]) -> tuple[StepTrace, ...]:
    """Two steps of two replicas whose mixtures each routed 100 tokens and received these."""
    return tuple(
        StepTrace(step, 0, r, 0.0, [], {}, comm={"ep": {"s": 0.01, "routed": 100, "received": n}})
        for step in range(2)
        for r, n in enumerate(received)
    )


def test_the_loops_prediction_of_a_mixtures_task_is_at_the_routing_measured() -> None:
    moe = resolve_model("moe-mini")
    assert isinstance(moe, TransformerSpec)
    cluster = ClusterSpec.model_validate(
        calibrated_cluster(load_spec(ClusterSpec, CLUSTER), MEASURED_CPU)
    )
    job = JobSpec(global_batch=8, micro_batch=4, dp=2, ep=2, schedule="1f1b")
    plan = plan_job(cluster, moe, job, fixed=True).plan
    kept = Predictions()

    def predicted(received: tuple[int, int]) -> tuple[float | None, str]:
        m = Measurements(run_id=1, plan=plan, taken_s=0.0, task_id=3, traces=_traces(received))
        p = kept.get(plan, cluster, moe, m)
        return p.step_s, p.basis

    step_s, basis = predicted((140, 60))
    assert "routing 1.40 of an even share" in basis
    assert step_s is not None and step_s > plan.prediction.iteration_time_s
    # an even routing: the plan's own figure (and the kept one is not reused for it)
    assert predicted((100, 100)) == (plan.prediction.iteration_time_s, "the plan's")
