"""``dmsc plan --compare`` as a library call: each solver's row is the plan that solver makes
of the same strategy alone (``dmsc plan --solver NAME``)."""

from __future__ import annotations

import pytest

from dmsc.planner.compare import compare_solvers
from dmsc.planner.solve import SOLVERS, place_job, plan_job
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def test_each_row_is_the_plan_its_solver_makes_alone(local_cpu: ClusterSpec) -> None:
    model = resolve_model("gpt-mini")
    job = JobSpec(global_batch=16, micro_batch=2, pp=3)
    outcome = plan_job(local_cpu, model, job, "milp", fixed=True)
    seen: list[str] = []
    rows = compare_solvers(local_cpu, model, outcome, "milp", seed=3, progress=seen.append)
    assert [r.solver for r in rows] == list(SOLVERS) == seen
    for row in rows:
        assert not row.blocked
        alone = (
            outcome
            if row.solver == "milp"
            else place_job(local_cpu, model, outcome.plan.job, outcome.strategy, row.solver, 3)
        )
        assert row.iteration_s == pytest.approx(alone.plan.prediction.iteration_time_s)
        assert row.as_dict()["iteration_s"] == row.iteration_s
    best = min(r.iteration_s for r in rows)
    assert rows[0].iteration_s == pytest.approx(best)  # the exact solver is never beaten
    assert rows[0].optimal
