"""Baseline placements: greedy first fit, compute-first (the network-unaware baseline of
004_899cf4a7bfe92fb3.txt) and seeded random; all reserve spectrum first-fit."""

from __future__ import annotations

import random
import time

from dmsc.planner.placement.problem import (
    Infeasible,
    PlacementProblem,
    PlacementResult,
    capacity_ok,
)
from dmsc.planner.placement.routing import feasible_dcs, placement_result, route_boundaries


def solve_greedy(problem: PlacementProblem) -> PlacementResult:
    """Stage by stage, the datacenter that adds least time given the previous stage's, routed
    first-fit along shortest paths."""
    t0 = time.perf_counter()
    options = feasible_dcs(problem)
    free = list(problem.free_devices)
    dcs: list[int] = []
    tried = 0
    for s in range(problem.n_stages):
        best: tuple[int, int] | None = None
        for d in options[s]:
            if free[d] < problem.devices[s]:
                continue
            tried += 1
            c = problem.compute_us[s][d]
            assert c is not None
            if s > 0 and dcs[-1] != d:
                paths = problem.paths.get((dcs[-1], d), ())
                if not paths:
                    continue
                c += 2 * problem.cross_us(s - 1, dcs[-1], d, 0, problem.levels[-1])
            elif s > 0:
                c += 2 * problem.local_us[s - 1][d]
            if best is None or c < best[0]:
                best = (c, d)
        if best is None:
            raise Infeasible(f"greedy: no datacenter left for stage {s}")
        dcs.append(best[1])
        free[best[1]] -= problem.devices[s]
    routes = route_boundaries(problem, dcs, shortest_only=True)
    if routes is None:
        raise Infeasible("greedy: no free spectrum on the shortest paths")
    return placement_result(problem, dcs, routes, "greedy", t0, tried)


def solve_compute_first(
    problem: PlacementProblem, fixed_units: int | None = None
) -> PlacementResult:
    """Communication-unaware baseline: each stage where it computes fastest (ties: the first
    datacenter with room), every crossing boundary a fixed share of capacity on its shortest
    path, first-fit."""
    t0 = time.perf_counter()
    options = feasible_dcs(problem)
    free = list(problem.free_devices)
    units = fixed_units if fixed_units is not None else problem.levels[len(problem.levels) // 2]
    dcs: list[int] = []
    for s in range(problem.n_stages):
        fits = [d for d in options[s] if free[d] >= problem.devices[s]]
        if not fits:
            raise Infeasible(f"compute-first: no datacenter left for stage {s}")
        d = min(fits, key=lambda d: (problem.compute_us[s][d], d))  # fastest, then first
        dcs.append(d)
        free[d] -= problem.devices[s]
    routes = route_boundaries(problem, dcs, fixed_units=units, shortest_only=True)
    if routes is None:
        raise Infeasible("compute-first: no free spectrum for the fixed share on shortest paths")
    return placement_result(problem, dcs, routes, "compute-first", t0, problem.n_stages)


def solve_random(problem: PlacementProblem, seed: int = 0, tries: int = 1000) -> PlacementResult:
    """Seeded random feasible placement (a floor for the others)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    options = feasible_dcs(problem)
    for attempt in range(1, tries + 1):
        dcs = [rng.choice(o) for o in options]
        if not capacity_ok(problem, dcs):
            continue
        caps = [rng.randrange(len(problem.levels)) for _ in range(problem.n_stages - 1)]
        routes = route_boundaries(problem, dcs, caps=caps)
        if routes is not None:
            return placement_result(problem, dcs, routes, "random", t0, attempt)
    raise Infeasible(f"random: no feasible placement in {tries} tries")
