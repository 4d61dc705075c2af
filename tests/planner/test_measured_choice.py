"""Planning on a fit keeps the placement the fit measured unless another is clearly faster
(:mod:`dmsc.planner.measured_choice`): on the CPU demo's cluster with its links fitted slower,
the search re-cuts the layers for a gain within the margin."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.planner.measured_choice import MARGIN, prefer_measured
from dmsc.planner.plan import Plan
from dmsc.planner.recalibrate import iteration_s, scaled
from dmsc.planner.solve import PlanOutcome, plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = resolve_model("gpt-mini")
JOB = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b")


def _cuts(plan: Plan) -> list[list[tuple[str, str]]]:
    return [st.chunks for st in plan.stages]


@pytest.fixture(scope="module")
def demo() -> tuple[Plan, ClusterSpec, PlanOutcome]:
    """The demo's plan on local-cpu (what a run measured), the cluster fitted with its links
    about 8 times slower (what this machine's runs fit to), and the search's plan there."""
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/local-cpu.yaml")
    measured = plan_job(cluster, MODEL, JOB, fixed=True).plan
    fit = scaled(cluster, {"cpu": 1.0}, {"dc-0-dc-1": 0.13, "dc-1-dc-2": 0.12})
    found = plan_job(fit, MODEL, JOB, fixed=True)
    assert _cuts(found.plan) != _cuts(measured)  # the search re-cut the layers on the fit
    return measured, fit, found


def test_a_placement_predicted_faster_within_the_margin_keeps_the_measured_one(
    demo: tuple[Plan, ClusterSpec, PlanOutcome],
) -> None:
    measured, fit, found = demo
    chosen, why = prefer_measured(found, measured, fit, MODEL)
    assert _cuts(chosen.plan) == _cuts(measured)
    assert [r.devices for st in chosen.plan.stages for r in st.replicas] == [[0], [1], [2]]
    # its prediction is the fit's own re-costing of the measured placement
    assert chosen.plan.prediction.iteration_time_s == pytest.approx(
        iteration_s(measured, fit, MODEL)
    )
    gain = 1 - found.plan.prediction.iteration_time_s / chosen.plan.prediction.iteration_time_s
    assert 0 < gain <= MARGIN
    assert why is not None and "kept the measured plan's placement" in why
    assert f"{gain:.1%} faster, within the {MARGIN:.0%} margin" in why


def test_a_placement_predicted_faster_over_the_margin_replaces_it(
    demo: tuple[Plan, ClusterSpec, PlanOutcome],
) -> None:
    measured, fit, found = demo
    chosen, why = prefer_measured(found, measured, fit, MODEL, margin=0.0)
    assert chosen is found
    assert why is not None and "over the 0% margin" in why


def test_another_job_or_the_same_placement_is_the_search_s_plan(
    demo: tuple[Plan, ClusterSpec, PlanOutcome],
) -> None:
    measured, fit, found = demo
    other = measured.model_copy(update={"job": measured.job.model_copy(update={"global_batch": 8})})
    assert prefer_measured(found, other, fit, MODEL) == (found, None)
    assert prefer_measured(found, found.plan, fit, MODEL) == (found, None)
