from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmsc.planner.placement import (
    pack_exactly,
    solve_bruteforce,
    solve_compute_first,
    solve_greedy,
    solve_random,
    solve_tabu,
)
from dmsc.planner.placement.instance_generator import random_problem
from dmsc.planner.placement.milp import solve_milp
from dmsc.planner.placement.problem import (
    Infeasible,
    LinkState,
    PathOption,
    Placement,
    PlacementProblem,
    Reservation,
    evaluate,
)


def _small(seed: int) -> PlacementProblem:
    return random_problem(seed, max_dcs=4, max_stages=5, max_combinations=20_000)


def _solvable(seed: int) -> PlacementProblem | None:
    p = _small(seed)
    try:
        solve_bruteforce(p)
    except Infeasible:
        return None
    return p


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000))
def test_milp_equals_bruteforce(seed: int) -> None:
    p = _solvable(seed)
    if p is None:  # brute force found nothing: the exact model must agree
        with pytest.raises(Infeasible):
            solve_milp(_small(seed))
        return
    exact = solve_bruteforce(p)
    milp = solve_milp(p)
    assert milp.optimal
    assert milp.objective == exact.objective
    assert evaluate(p, milp.placement) == milp.objective
    # of equal placements, the one brute force meets first (least datacenters, routes, units)
    assert milp.placement == exact.placement


def test_milp_gives_the_same_placement_of_equal_ones_on_every_run() -> None:
    # seed 279 has two optimal packings of its crossings' units; the parallel search returned
    # either before the tie was broken (12 of the first 282 solvable seeds differed from brute
    # force, this one about half the time)
    p = _small(279)
    exact = solve_bruteforce(p)
    assert {solve_milp(p).placement for _ in range(8)} == {exact.placement}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000))
def test_heuristics_are_valid_and_never_beat_the_optimum(seed: int) -> None:
    p = _solvable(seed)
    if p is None:
        return
    best = solve_bruteforce(p).objective
    for solve in (solve_tabu, solve_greedy, solve_compute_first, solve_random):
        try:
            r = solve(p)
        except Infeasible:
            continue  # a baseline may block a request the optimum serves
        assert evaluate(p, r.placement) == r.objective
        assert r.objective >= best


def test_seeded_solvers_are_deterministic() -> None:
    p = random_problem(9)
    a, b = solve_tabu(p, seed=3), solve_tabu(p, seed=3)
    assert (a.placement, a.objective) == (b.placement, b.objective)
    a, b = solve_random(p, seed=5), solve_random(p, seed=5)
    assert (a.placement, a.objective) == (b.placement, b.objective)


def _two_dc(
    units: int = 8, busy: frozenset[int] = frozenset(), free: tuple[int, int] = (8, 8)
) -> PlacementProblem:
    path = PathOption((0,), 600.0, 3000, 50.0)
    return PlacementProblem(
        dc_names=("a", "b"),
        free_devices=free,
        devices=(8, 8),
        compute_us=((10_000, 10_000), (10_000, 10_000)),
        boundary_bytes=(100e6,),
        local_us=((100, 100),),
        links=(LinkState("a-b", units, busy),),
        paths={(0, 1): (path,), (1, 0): (path,)},
        levels=(2, 4),
        microbatches=8,
    )


def test_two_datacenters_by_hand() -> None:
    p = _two_dc()
    r = solve_milp(p)
    # 4 units of 50 Gbit/s at 95%: 100 MB in 4210.5 us, plus 3000 us of fiber.
    cross = 3000 + round(100e6 / (4 * 50e9 / 8 * 0.95) * 1e6)
    t = 10_000 + 2 * cross
    assert r.objective == 1 * 2 * 8 * t + 1 * (2 * t)
    assert r.placement.routes[0] is not None and r.placement.routes[0].units == 4


def test_busy_spectrum_forces_a_smaller_range() -> None:
    p = _two_dc(busy=frozenset({3, 7}))  # free runs: 0-2 and 4-6
    r = solve_milp(p)
    route = r.placement.routes[0]
    assert route is not None and route.units == 2
    assert solve_bruteforce(p).objective == r.objective


def test_infeasible_requests_name_the_constraint() -> None:
    with pytest.raises(Infeasible, match="needs 8 devices"):
        solve_milp(_two_dc(free=(4, 4)))
    with pytest.raises(Infeasible, match="no placement"):
        solve_milp(_two_dc(busy=frozenset(range(0, 8, 2))))  # no two adjacent free units
    with pytest.raises(Infeasible):
        solve_bruteforce(_two_dc(busy=frozenset(range(0, 8, 2))))


def test_evaluate_rejects_broken_placements() -> None:
    p = _two_dc()
    ok = Placement((0, 1), (Reservation(0, 4, 0),))
    assert evaluate(p, ok) is not None
    assert evaluate(p, Placement((0, 1), (None,))) is None  # crossing without a route
    assert evaluate(p, Placement((0, 1), (Reservation(0, 4, 6),))) is None  # past the last unit
    assert evaluate(_two_dc(busy=frozenset({1})), ok) is None  # on a busy unit


def test_pack_exactly_finds_what_first_fit_misses() -> None:
    # One link of 6 units; boundary 0 wants 2, boundary 1 wants 4 on the same link.
    path = PathOption((0,), 100.0, 500, 50.0)
    p = PlacementProblem(
        dc_names=("a", "b", "c"),
        free_devices=(8, 8, 8),
        devices=(8, 8, 8),
        compute_us=((1000,) * 3,) * 3,
        boundary_bytes=(1e6, 1e6),
        local_us=((10,) * 3,) * 2,
        links=(LinkState("l", 6, frozenset({2})),),
        paths={(a, z): (path,) for a in range(3) for z in range(3) if a != z},
        levels=(2, 3),
    )
    starts = pack_exactly(p, (0, 1, 2), {0: (0, 2), 1: (0, 3)})
    assert starts == {0: 0, 1: 3}
    assert pack_exactly(p, (0, 1, 2), {0: (0, 3), 1: (0, 3)}) is None


def test_planner_recuts_layers_for_the_placed_pipeline() -> None:
    from pathlib import Path

    from dmsc.planner.placement.from_specs import build_problem
    from dmsc.planner.placement.problem import score_to_seconds
    from dmsc.planner.solve import plan_job
    from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

    root = Path(__file__).resolve().parents[3]
    cluster = load_spec(ClusterSpec, root / "examples" / "clusters" / "nsfnet-4dc.yaml")
    model = resolve_model("llama3-8b")
    job = JobSpec(global_batch=64, tp=8, pp=4, dp=32, recompute="selective", sequence_parallel=True)
    outcome = plan_job(cluster, model, job, fixed=True)
    even = build_problem(cluster, model, job)
    even_s = score_to_seconds(even.problem, solve_milp(even.problem).objective)
    planned_s = score_to_seconds(outcome.built.problem, outcome.result.objective)
    assert planned_s <= even_s
    layers = outcome.plan.job.stage_layers
    if layers is not None:  # the re-cut won: its stages add up and the plan shows them
        assert sum(layers) == model.layers
        assert [s.layers for s in outcome.plan.stages][1:-1] == layers[1:-1]
