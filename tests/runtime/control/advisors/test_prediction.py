"""A task's measured step is compared with the prediction for the job that ran (issue 29, 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import MEASURED_CPU

from dmsc.planner.solve import plan_job
from dmsc.runtime.compute.calibrate import calibrated_cluster
from dmsc.runtime.control.advisors.prediction import prediction_for
from dmsc.runtime.control.training.resize import resized_plan
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

CLUSTERS = Path(__file__).resolve().parents[4] / "examples" / "clusters"
LOCAL = CLUSTERS / "local-cpu.yaml"
FIGURES = MEASURED_CPU
JOB = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)


def _cluster(template_path: Path = LOCAL, **changes: float) -> ClusterSpec:
    template = load_spec(ClusterSpec, template_path)
    return ClusterSpec.model_validate(calibrated_cluster(template, {**FIGURES, **changes}))


@pytest.fixture(scope="module")
def model() -> TransformerSpec:
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    return spec


def test_the_plans_own_job_takes_the_plans_prediction(model: TransformerSpec) -> None:
    cluster = _cluster()
    plan = plan_job(cluster, model, JOB, fixed=True).plan
    for known in (cluster, None):
        p = prediction_for(plan, known, model, 16, 4, 1)
        assert p.step_s == plan.prediction.iteration_time_s and p.basis == "the plan's"


def test_another_batch_is_re_estimated_for_the_batch_that_ran(model: TransformerSpec) -> None:
    """`dmsc train --batch 32` was compared with the batch-16 prediction ("409% slower")."""
    cluster = _cluster()
    plan = plan_job(cluster, model, JOB, fixed=True).plan
    p = prediction_for(plan, cluster, model, 32, 4, 1)
    job32 = JobSpec.model_validate({**JOB.model_dump(), "global_batch": 32, "micro_batch": 8})
    assert p.step_s == plan_job(cluster, model, job32, fixed=True).plan.prediction.iteration_time_s
    assert p.step_s > 1.5 * plan.prediction.iteration_time_s
    assert "re-estimated for batch 32 in 4 micro-batches at dp 1" in p.basis
    # without the cluster spec there is nothing to re-estimate on: said so, no figure
    q = prediction_for(plan, None, model, 32, 4, 1)
    assert q.step_s is None and q.basis.startswith("not comparable:") and "batch 32" in q.basis
    assert q.as_json()["not_comparable"] == q.basis


def test_after_a_resize_the_job_that_ran_is_predicted(model: TransformerSpec) -> None:
    """A task that resized to dp 2 kept its 4 micro-batches per replica (of 2 sequences); the
    resized plan predicts 2 micro-batches of 4: another job."""
    cluster = _cluster(CLUSTERS / "three-sites-cpu.yaml")
    plan = plan_job(cluster, model, JOB, fixed=True).plan
    resized = resized_plan(plan, model, cluster, 2)
    assert resized.job.microbatches == 2
    p = prediction_for(resized, cluster, model, 16, 4, 2)
    ran = JobSpec.model_validate({**JOB.model_dump(), "micro_batch": 2, "dp": 2})
    assert p.step_s == plan_job(cluster, model, ran, fixed=True).plan.prediction.iteration_time_s
    assert p.step_s != resized.prediction.iteration_time_s


def test_a_recalibrated_spec_re_estimates_the_plans_job(model: TransformerSpec) -> None:
    plan = plan_job(_cluster(), model, JOB, fixed=True).plan
    slower = _cluster(block_s=0.06)
    p = prediction_for(plan, slower, model, 16, 4, 1)
    assert p.step_s is not None and p.step_s > 1.3 * plan.prediction.iteration_time_s
    assert "cluster spec now in force" in p.basis


def test_an_uncalibrated_cpu_is_not_compared(model: TransformerSpec) -> None:
    """The tiny Llama on the uncalibrated local-cpu predicted 8 ms against 70 ms measured: the
    spec's CPU figures are guesses, so there is nothing to compare with."""
    guesses = load_spec(ClusterSpec, LOCAL)
    plan = plan_job(guesses, model, JOB, fixed=True).plan
    p = prediction_for(plan, guesses, model, 16, 4, 1)
    assert p.step_s is None and "device type cpu" in p.basis and "dmsc calibrate" in p.basis


def test_the_train_line_names_what_it_compares_with() -> None:
    from dmsc.cli.render import prediction_words

    assert prediction_words(0.3, None, "not comparable: why") == "not comparable: why"
    assert prediction_words(0.3, 0.2, "the plan's") == (
        "predicted 200.0 ms: measured 50.0% slower than predicted"
    )
    words = prediction_words(0.3, 0.2, "re-estimated for batch 32 in 4 micro-batches at dp 1")
    assert words.startswith("predicted 200.0 ms, re-estimated for batch 32 in 4 micro-batches")
