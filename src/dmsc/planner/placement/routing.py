"""Shared steps of the placement heuristics: feasible datacenters, first-fit routing of the
crossing boundaries, and the scored result every heuristic returns."""

from __future__ import annotations

import time
from collections.abc import Sequence

from dmsc.planner.placement.problem import (
    Infeasible,
    Placement,
    PlacementProblem,
    PlacementResult,
    Reservation,
    boundary_us,
    first_fit,
    reserve,
    score,
    stage_us,
)


def feasible_dcs(problem: PlacementProblem) -> list[list[int]]:
    options = []
    for s in range(problem.n_stages):
        ok = [
            d
            for d in range(problem.n_dcs)
            if problem.compute_us[s][d] is not None
            and problem.devices[s] <= problem.free_devices[d]
        ]
        if not ok:
            raise Infeasible(
                f"stage {s} needs {problem.devices[s]} devices in one datacenter; the most free "
                f"in any is {max(problem.free_devices)}"
            )
        options.append(ok)
    if sum(problem.devices) > sum(problem.free_devices):
        raise Infeasible(
            f"the stages need {sum(problem.devices)} devices, the datacenters have "
            f"{sum(problem.free_devices)} free"
        )
    return options


def route_boundaries(
    problem: PlacementProblem,
    dcs: Sequence[int],
    caps: Sequence[int] | None = None,
    fixed_units: int | None = None,
    shortest_only: bool = False,
) -> tuple[Reservation | None, ...] | None:
    """Routes for every crossing boundary, in order, first-fit; None when one cannot be routed.

    Each boundary takes the option (path, units) with the shortest transfer among those that fit,
    with at most ``caps[b]`` as index into the levels, or exactly ``fixed_units``.
    """
    routes, failed = route_first_fit(problem, dcs, caps, fixed_units, shortest_only)
    return None if failed else routes


def route_first_fit(
    problem: PlacementProblem,
    dcs: Sequence[int],
    caps: Sequence[int] | None,
    fixed_units: int | None,
    shortest_only: bool,
) -> tuple[tuple[Reservation | None, ...], list[int]]:
    """Routes as far as they go, and the crossing boundaries that found no free spectrum."""
    taken: dict[int, int] = {}
    routes: list[Reservation | None] = []
    failed: list[int] = []
    for b in range(problem.n_stages - 1):
        a, z = dcs[b], dcs[b + 1]
        if a == z:
            routes.append(None)
            continue
        options = problem.paths.get((a, z), ())
        if shortest_only:
            options = options[:1]
        levels = problem.levels if caps is None else problem.levels[: caps[b] + 1]
        if fixed_units is not None:
            levels = (fixed_units,)
        best: tuple[int, Reservation] | None = None
        for k, path in enumerate(options):
            for n in levels:
                start = first_fit(problem, path, n, taken)
                if start is None:
                    continue
                t = problem.cross_us(b, a, z, k, n)
                if best is None or t < best[0]:
                    best = (t, Reservation(k, n, start))
        if best is None:
            failed.append(b)
            routes.append(None)
            continue
        route = best[1]
        reserve(options[route.path], route.start, route.units, taken)
        routes.append(route)
    return tuple(routes), failed


def objective(
    problem: PlacementProblem, dcs: Sequence[int], routes: Sequence[Reservation | None]
) -> int:
    return score(problem, stage_us(problem, dcs, boundary_us(problem, dcs, routes)))


def placement_result(
    problem: PlacementProblem,
    dcs: Sequence[int],
    routes: Sequence[Reservation | None],
    solver: str,
    t0: float,
    candidates: int,
    **kw: object,
) -> PlacementResult:
    return PlacementResult(
        Placement(tuple(dcs), tuple(routes)),
        objective(problem, dcs, routes),
        solver,
        time.perf_counter() - t0,
        candidates=candidates,
        **kw,  # type: ignore[arg-type]
    )
