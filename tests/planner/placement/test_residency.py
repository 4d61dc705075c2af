"""Residency as a placement constraint: every solver keeps a resident model's stages in the
datacenters its rules allow; the exact model equals brute force on the same instances with the
forbidden datacenters marked as unable to run the stages (the problem's older way of saying a
stage cannot go somewhere, independent of the residency code)."""

from __future__ import annotations

import dataclasses

import pytest

from dmsc.planner.placement import solve_bruteforce, solve_greedy, solve_tabu
from dmsc.planner.placement.instance_generator import random_problem
from dmsc.planner.placement.milp import solve_milp
from dmsc.planner.placement.problem import Infeasible, PlacementProblem, evaluate
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def _resident(p: PlacementProblem, keep: frozenset[int]) -> PlacementProblem:
    return dataclasses.replace(p, resident_dcs=keep, residency_rules=("r",), cross_us_cache={})


def _reference(p: PlacementProblem, keep: frozenset[int]) -> PlacementProblem:
    compute = tuple(
        tuple(c if d in keep else None for d, c in enumerate(row)) for row in p.compute_us
    )
    return dataclasses.replace(p, compute_us=compute, cross_us_cache={})


@pytest.mark.parametrize("seed", range(12))
def test_the_exact_model_with_residency_equals_brute_force(seed: int) -> None:
    p = random_problem(seed, max_dcs=4, max_stages=4, max_combinations=5_000)
    keep = frozenset(range(0, p.n_dcs, 2)) | {p.n_dcs - 1}  # about half of the datacenters
    try:
        exact = solve_bruteforce(_reference(p, keep))
    except Infeasible:
        with pytest.raises(Infeasible):
            solve_milp(_resident(p, keep))
        return
    milp = solve_milp(_resident(p, keep))
    assert milp.objective == exact.objective
    assert milp.placement == exact.placement
    assert set(milp.placement.dcs) <= keep
    for heuristic in (solve_tabu(_resident(p, keep), seed=seed), solve_greedy(_resident(p, keep))):
        assert set(heuristic.placement.dcs) <= keep
        assert heuristic.objective >= exact.objective


def test_a_placement_in_a_forbidden_datacenter_does_not_evaluate() -> None:
    p = random_problem(1, max_dcs=3, max_stages=3, max_combinations=5_000)
    best = solve_bruteforce(p)
    used = frozenset(best.placement.dcs)
    others = frozenset(range(p.n_dcs)) - used
    assert evaluate(_resident(p, used), best.placement) == best.objective
    assert evaluate(_resident(p, others), best.placement) is None


def test_a_rule_that_leaves_no_datacenter_is_named() -> None:
    p = random_problem(2, max_dcs=3, max_stages=3, max_combinations=5_000)
    p = dataclasses.replace(p, resident_dcs=frozenset(), residency_rules=("eu-only",))
    with pytest.raises(Infeasible, match="residency rule 'eu-only'"):
        solve_milp(p)


def _with_rule(cluster: ClusterSpec, model: str, dcs: list[str]) -> ClusterSpec:
    data = cluster.model_dump(mode="json", exclude_none=True)
    data["residency"] = {"rules": [{"name": "keep-it", "models": [model], "datacenters": dcs}]}
    return ClusterSpec.model_validate(data)


def test_the_planner_keeps_the_stages_where_the_rule_says(local_cpu: ClusterSpec) -> None:
    model = resolve_model("gpt-mini")
    job = JobSpec(global_batch=16, micro_batch=2, pp=2)
    free = plan_job(local_cpu, model, job, "milp", fixed=True).plan
    used = {st.datacenter for st in free.stages}
    banned = free.stages[0].datacenter
    allowed = [dc.name for dc in local_cpu.datacenters if dc.name != banned]
    kept = plan_job(_with_rule(local_cpu, model.name, allowed), model, job, "milp", fixed=True)
    assert banned not in {st.datacenter for st in kept.plan.stages}
    other = plan_job(_with_rule(local_cpu, "another-model", allowed), model, job, fixed=True)
    assert {st.datacenter for st in other.plan.stages} == used  # the rule names another model
    nowhere = _with_rule(local_cpu, model.name, [banned])  # one device for two stages
    with pytest.raises(Infeasible, match="residency rule 'keep-it'"):
        plan_job(nowhere, model, job, "milp", fixed=True)
