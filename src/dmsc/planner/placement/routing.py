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
    reserve,
    score,
    stage_us,
)


def _rules(problem: PlacementProblem) -> str:
    names = problem.residency_rules
    return f"residency rule{'s' if len(names) > 1 else ''} " + ", ".join(repr(n) for n in names)


def feasible_dcs(problem: PlacementProblem) -> list[list[int]]:
    options = []
    for s in range(problem.n_stages):
        ok = [
            d
            for d in range(problem.n_dcs)
            if problem.compute_us[s][d] is not None
            and problem.devices[s] <= problem.free_devices[d]
        ]
        held = [d for d in ok if problem.may_hold(d)]
        if ok and not held:
            names = ", ".join(problem.dc_names[d] for d in ok)
            raise Infeasible(
                f"{_rules(problem)} keeps the model's weights out of every datacenter that can "
                f"hold stage {s} ({names})"
            )
        ok = held
        if not ok:
            raise Infeasible(
                f"stage {s} needs {problem.devices[s]} devices in one datacenter; the most free "
                f"in any is {max(problem.free_devices)}"
            )
        options.append(ok)
    held_free = sum(f for d, f in enumerate(problem.free_devices) if problem.may_hold(d))
    if sum(problem.free_devices) >= sum(problem.devices) > held_free:
        raise Infeasible(
            f"the stages need {sum(problem.devices)} devices; {_rules(problem)} leaves "
            f"{held_free} free in the datacenters it allows"
        )
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
    routes, failed, _ = route_with_times(problem, dcs, caps, fixed_units, shortest_only)
    return routes, failed


def route_with_times(
    problem: PlacementProblem,
    dcs: Sequence[int],
    caps: Sequence[int] | None,
    fixed_units: int | None,
    shortest_only: bool,
    unrouted_us: int = 0,
) -> tuple[tuple[Reservation | None, ...], list[int], list[int]]:
    """:func:`route_first_fit` with each boundary's transfer time (as
    :func:`~dmsc.planner.placement.problem.boundary_us` gives it; ``unrouted_us`` for a
    boundary that found no spectrum).

    Each boundary takes, of the (path, units) options that fit, the one with the shortest
    transfer, ties to the first in path-then-level order: the options are ranked once per
    problem (:func:`ranked_options`) and tried in that order until one fits."""
    taken: dict[int, int] = {}
    routes: list[Reservation | None] = []
    failed: list[int] = []
    comm: list[int] = []
    cache = problem.routing_cache
    for b in range(len(dcs) - 1):
        a, z = dcs[b], dcs[b + 1]
        if a == z:
            routes.append(None)
            comm.append(problem.local_us[b][a])
            continue
        key = ("ranked", b, a, z, fixed_units, None if caps is None else caps[b], shortest_only)
        ranked = cache.get(key)
        if ranked is None:
            if fixed_units is not None:
                levels: tuple[int, ...] = (fixed_units,)
            else:
                levels = problem.levels if caps is None else problem.levels[: caps[b] + 1]
            ranked = cache[key] = ranked_options(problem, b, a, z, levels, shortest_only)
        route: Reservation | None = None
        for t, k, n in ranked:  # type: ignore[attr-defined]
            start = _fit(problem, a, z, k, n, taken)
            if start is not None:
                route = Reservation(k, n, start)
                comm.append(t)
                break
        if route is None:
            failed.append(b)
            routes.append(None)
            comm.append(unrouted_us)
            continue
        reserve(problem.paths[(a, z)][route.path], route.start, route.units, taken)
        routes.append(route)
    return tuple(routes), failed, comm


def ranked_options(
    problem: PlacementProblem,
    b: int,
    a: int,
    z: int,
    levels: tuple[int, ...],
    shortest_only: bool,
) -> tuple[tuple[int, int, int], ...]:
    """(transfer us, path, units) options of boundary ``b`` from DC ``a`` to ``z``, fastest
    transfer first, ties in path-then-level order (a stable sort)."""
    options = problem.paths.get((a, z), ())
    n_paths = min(1, len(options)) if shortest_only else len(options)
    timed = [(problem.cross_us(b, a, z, k, n), k, n) for k in range(n_paths) for n in levels]
    timed.sort(key=lambda c: c[0])
    return tuple(timed)


def _path_state(problem: PlacementProblem, a: int, z: int, k: int) -> tuple[int, int]:
    """Units busy on any link of path ``k`` from ``a`` to ``z`` (bits), and its unit count."""
    key = ("path", a, z, k)
    hit = problem.routing_cache.get(key)
    if hit is None:
        path = problem.paths[(a, z)][k]
        busy = 0
        for lid in path.links:
            busy |= problem.links[lid].busy_mask
        hit = (busy, min(problem.links[lid].units for lid in path.links))
        problem.routing_cache[key] = hit
    return hit  # type: ignore[return-value]


def _fit(
    problem: PlacementProblem, a: int, z: int, k: int, units: int, taken: dict[int, int]
) -> int | None:
    """:func:`~dmsc.planner.placement.problem.first_fit` on path ``k`` from ``a`` to ``z``,
    with the path's busy units computed once, runs found by doubling shifts, and the answer
    kept while nothing is ``taken`` (it then depends on the problem alone)."""
    if not taken:
        key = ("fit", a, z, k, units)
        cache = problem.routing_cache
        if key not in cache:
            cache[key] = _fit_on(problem, a, z, k, units, taken)
        return cache[key]  # type: ignore[return-value]
    return _fit_on(problem, a, z, k, units, taken)


def _fit_on(
    problem: PlacementProblem, a: int, z: int, k: int, units: int, taken: dict[int, int]
) -> int | None:
    busy, limit = _path_state(problem, a, z, k)
    if units > limit:
        return None
    if taken:
        for lid in problem.paths[(a, z)][k].links:
            busy |= taken.get(lid, 0)
    run = ~busy & ((1 << limit) - 1)
    length = 1  # bit s of run set: units s .. s + length - 1 are free
    while run and length < units:
        step = min(length, units - length)
        run &= run >> step
        length += step
    if not run:
        return None
    return (run & -run).bit_length() - 1


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
