"""The plan document's figures: runners-up measured against the plan they lost to."""

from __future__ import annotations

import re

import pytest

from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def test_why_lost_is_the_difference_of_the_two_figures() -> None:
    from dmsc.planner.strategy import why_lost

    best = {"compute": 10.0, "bubble": 2.0, "dp_comm": 1.0}
    other = {"compute": 10.2, "bubble": 2.5, "dp_comm": 0.9}
    assert why_lost(best, 20.957, other, 21.584) == "+0.627 s, mostly bubble (+0.5 s)"


def test_runner_up_deltas_are_against_the_plans_iteration(local_cpu: ClusterSpec) -> None:
    outcome = plan_job(local_cpu, resolve_model("gpt-mini"), JobSpec(global_batch=16))
    plan = outcome.plan
    assert outcome.strategy is not None and plan.search.alternatives
    # Placement and the re-cut move the chosen strategy away from its search estimate.
    searched = outcome.strategy.best.time_s
    assert abs(plan.prediction.iteration_time_s - searched) > 0.01 * searched
    for alt in plan.search.alternatives:
        match = re.match(r"([+-][0-9.e+-]+) s", alt.why_lost)
        assert match, alt.why_lost
        expected = alt.iteration_time_s - plan.prediction.iteration_time_s
        assert float(match.group(1)) == pytest.approx(expected, rel=6e-3, abs=1e-9)
