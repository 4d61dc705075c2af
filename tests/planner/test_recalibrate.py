"""The recalibration fit (:mod:`dmsc.planner.recalibrate`) against figures the cost model itself
made from known parameters: it must give those parameters back."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import run_figures_on

from dmsc.planner.plan import Plan
from dmsc.planner.recalibrate import (
    CannotFit,
    RunFigures,
    fit_run,
    scaled,
)
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = resolve_model("gpt-mini")
TRUE_SPEED = {"cpu": 0.6}
TRUE_LINKS = {"dc-0-dc-1": 0.25, "dc-1-dc-2": 0.5}


@pytest.fixture(scope="module")
def demo() -> tuple[Plan, ClusterSpec]:
    """The CPU demo's job (gpt-mini, pp=3, 4 micro-batches of 4, 1F1B) on local-cpu."""
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/local-cpu.yaml")
    job = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    return plan_job(cluster, MODEL, job, fixed=True).plan, cluster


def figures_of(plan: Plan, true: ClusterSpec, step_s: float | None = None) -> RunFigures:
    """What a run on ``true`` measures, as the cost model predicts it."""
    figures: RunFigures = run_figures_on(plan, true, MODEL, step_s)
    return figures


def test_figures_made_from_known_parameters_are_fitted_back_to_them(
    demo: tuple[Plan, ClusterSpec],
) -> None:
    plan, cluster = demo
    true = scaled(cluster, TRUE_SPEED, TRUE_LINKS)
    fit = fit_run(plan, cluster, figures_of(plan, true), source="test")
    # the figures are whole microseconds in the cost model: a part in a thousand
    assert fit.device_speed["cpu"] == pytest.approx(0.6, rel=1e-3)
    assert fit.span_speed["cpu"] == pytest.approx(0.6, rel=1e-3)
    assert fit.step_factor == pytest.approx(1.0, rel=1e-3)
    assert fit.link_scale == pytest.approx(TRUE_LINKS, rel=1e-2)
    got = ClusterSpec.model_validate(fit.cluster)
    want = true.device_types["cpu"]
    assert got.device_types["cpu"].peak_tflops["fp32"] == pytest.approx(
        want.peak_tflops["fp32"], rel=1e-3
    )
    assert got.device_types["cpu"].memory_bw_gbyte_s == pytest.approx(
        want.memory_bw_gbyte_s, rel=1e-3
    )
    bandwidth = {f"{lk.a}-{lk.b}": lk.bandwidth_gbit_s for lk in got.links}
    assert bandwidth == pytest.approx({f"{lk.a}-{lk.b}": lk.bandwidth_gbit_s for lk in true.links},
                                      rel=1e-2)  # fmt: skip
    assert got.device_types["cpu"].measured is not None
    assert got.device_types["cpu"].measured.source == "test"
    # the prediction on the fitted spec is the measured step; before, the plan's
    assert fit.predicted_after_s == pytest.approx(fit.measured_step_s, rel=1e-3)
    assert fit.predicted_before_s == pytest.approx(plan.prediction.iteration_time_s, rel=1e-3)
    assert [st.speed for st in fit.stages] == pytest.approx([0.6] * 3, rel=1e-3)


def test_a_step_longer_than_its_spans_slows_the_devices_by_a_stated_factor(
    demo: tuple[Plan, ClusterSpec],
) -> None:
    plan, cluster = demo
    true = scaled(cluster, TRUE_SPEED, {})
    made = figures_of(plan, true)
    longer = RunFigures(made.stage_s, made.boundaries, made.step_s * 1.2, made.steps)
    fit = fit_run(plan, cluster, longer)
    assert fit.span_speed["cpu"] == pytest.approx(0.6, rel=1e-3)
    assert fit.step_factor < 1.0
    assert fit.device_speed["cpu"] == pytest.approx(fit.span_speed["cpu"] * fit.step_factor)
    assert fit.predicted_after_s == pytest.approx(longer.step_s, rel=1e-3)


def test_figures_without_stages_or_step_cannot_be_fitted(demo: tuple[Plan, ClusterSpec]) -> None:
    plan, cluster = demo
    with pytest.raises(CannotFit, match="no stage"):
        fit_run(plan, cluster, RunFigures({}, {}, 0.3))
    with pytest.raises(CannotFit, match="no step time"):
        fit_run(plan, cluster, RunFigures({0: 0.1}, {}, 0.0))
