"""Placement solvers other than the exact model: brute force, tabu, greedy, baselines.

All take a :class:`PlacementProblem` and return a :class:`PlacementResult` scored by
:func:`dmsc.control.problem.evaluate`; all but brute force reserve spectrum first-fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Sequence

from dmsc.control.problem import (
    Infeasible,
    Placement,
    PlacementProblem,
    PlacementResult,
    Route,
    boundary_us,
    capacity_ok,
    first_fit,
    reserve,
    score,
    stage_us,
)


def _feasible_dcs(problem: PlacementProblem) -> list[list[int]]:
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
) -> tuple[Route | None, ...] | None:
    """Routes for every crossing boundary, in order, first-fit; None when one cannot be routed.

    Each boundary takes the option (path, units) with the shortest transfer among those that fit,
    with at most ``caps[b]`` as index into the levels, or exactly ``fixed_units``.
    """
    routes, failed = _route(problem, dcs, caps, fixed_units, shortest_only)
    return None if failed else routes


def _route(
    problem: PlacementProblem,
    dcs: Sequence[int],
    caps: Sequence[int] | None,
    fixed_units: int | None,
    shortest_only: bool,
) -> tuple[tuple[Route | None, ...], list[int]]:
    """Routes as far as they go, and the crossing boundaries that found no free spectrum."""
    taken: dict[int, int] = {}
    routes: list[Route | None] = []
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
        best: tuple[int, Route] | None = None
        for k, path in enumerate(options):
            for n in levels:
                start = first_fit(problem, path, n, taken)
                if start is None:
                    continue
                t = problem.cross_us(b, a, z, k, n)
                if best is None or t < best[0]:
                    best = (t, Route(k, n, start))
        if best is None:
            failed.append(b)
            routes.append(None)
            continue
        route = best[1]
        reserve(options[route.path], route.start, route.units, taken)
        routes.append(route)
    return tuple(routes), failed


def _objective(
    problem: PlacementProblem, dcs: Sequence[int], routes: Sequence[Route | None]
) -> int:
    return score(problem, stage_us(problem, dcs, boundary_us(problem, dcs, routes)))


def _result(
    problem: PlacementProblem,
    dcs: Sequence[int],
    routes: Sequence[Route | None],
    solver: str,
    t0: float,
    candidates: int,
    **kw: object,
) -> PlacementResult:
    return PlacementResult(
        Placement(tuple(dcs), tuple(routes)),
        _objective(problem, dcs, routes),
        solver,
        time.perf_counter() - t0,
        candidates=candidates,
        **kw,  # type: ignore[arg-type]
    )


def solve_greedy(problem: PlacementProblem) -> PlacementResult:
    """Stage by stage, the datacenter that adds least time given the previous stage's, routed
    first-fit along shortest paths."""
    t0 = time.perf_counter()
    options = _feasible_dcs(problem)
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
    return _result(problem, dcs, routes, "greedy", t0, tried)


def solve_compute_first(
    problem: PlacementProblem, fixed_units: int | None = None
) -> PlacementResult:
    """Communication-unaware baseline: each stage where it computes fastest (ties: the first
    datacenter with room), every crossing boundary a fixed share of capacity on its shortest
    path, first-fit."""
    t0 = time.perf_counter()
    options = _feasible_dcs(problem)
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
    return _result(problem, dcs, routes, "compute-first", t0, problem.n_stages)


def solve_random(problem: PlacementProblem, seed: int = 0, tries: int = 1000) -> PlacementResult:
    """Seeded random feasible placement (a floor for the others)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    options = _feasible_dcs(problem)
    for attempt in range(1, tries + 1):
        dcs = [rng.choice(o) for o in options]
        if not capacity_ok(problem, dcs):
            continue
        caps = [rng.randrange(len(problem.levels)) for _ in range(problem.n_stages - 1)]
        routes = route_boundaries(problem, dcs, caps=caps)
        if routes is not None:
            return _result(problem, dcs, routes, "random", t0, attempt)
    raise Infeasible(f"random: no feasible placement in {tries} tries")


def solve_tabu(
    problem: PlacementProblem,
    seed: int = 0,
    iterations: int = 300,
    tenure: int = 7,
    patience: int = 40,
    restarts: int = 3,
) -> PlacementResult:
    """Tabu search (see :func:`_tabu_once`) from the greedy placement and from ``restarts - 1``
    seeded random ones; the best result wins."""
    t0 = time.perf_counter()
    starts: list[tuple[int, ...] | None] = [None]
    for r in range(1, restarts):
        try:
            starts.append(solve_random(problem, seed + r).placement.dcs)
        except Infeasible:
            break
    results = []
    for i, start in enumerate(starts):
        try:
            results.append(_tabu_once(problem, seed + i, iterations, tenure, patience, start))
        except Infeasible:
            continue
    if not results:
        raise Infeasible("tabu: no placement could be routed")
    best = min(results, key=lambda r: r.objective)
    return dataclasses.replace(
        best,
        seconds=time.perf_counter() - t0,
        candidates=sum(r.candidates for r in results),
    )


def _tabu_once(
    problem: PlacementProblem,
    seed: int,
    iterations: int,
    tenure: int,
    patience: int,
    start_dcs: tuple[int, ...] | None,
) -> PlacementResult:
    """Tabu search over stage datacenters and per-boundary capacity caps.

    Moves: put one stage, or a run of consecutive stages sharing a datacenter, in another
    datacenter, swap two stages' datacenters, or lower/raise one boundary's capacity cap (less
    spectrum for one boundary can free a better route for another).
    A move is tabu for ``tenure`` iterations after it is undone, unless it beats the best. The
    search stops after ``iterations``, or ``patience`` iterations without a new best.
    """
    t0 = time.perf_counter()
    rng = random.Random(seed)
    options = _feasible_dcs(problem)
    if start_dcs is not None:
        start = start_dcs
    else:
        try:
            start = solve_greedy(problem).placement.dcs
        except Infeasible:
            start = solve_random(problem, seed).placement.dcs
    top = len(problem.levels) - 1
    state = (tuple(start), tuple([top] * (problem.n_stages - 1)))

    # States whose routing fails stay reachable at a penalty (each unrouted boundary costs as
    # if it took ten times the slowest compute), so the search can cross them.
    penalty = 10 * max(c for row in problem.compute_us for c in row if c is not None)

    def value(
        st: tuple[tuple[int, ...], tuple[int, ...]],
    ) -> tuple[int, tuple[Route | None, ...], bool] | None:
        dcs, caps = st
        if not capacity_ok(problem, dcs):
            return None
        routes, failed = _route(problem, dcs, caps, None, False)
        if not failed:
            return _objective(problem, dcs, routes), routes, True
        comm = [
            penalty
            if b in failed
            else (
                problem.local_us[b][dcs[b]]
                if dcs[b] == dcs[b + 1]
                else problem.cross_us(b, dcs[b], dcs[b + 1], r.path, r.units)
            )
            for b, r in enumerate(routes)
            for r in [routes[b] or Route(0, 0, 0)]
        ]
        return score(problem, stage_us(problem, dcs, comm)), routes, False

    current = value(state)
    if current is None:
        raise Infeasible("tabu: the start placement does not fit")
    best_state, best = state, current
    if not current[2]:
        best = (2**62, current[1], False)  # nothing feasible seen yet
    tabu: dict[tuple[object, ...], int] = {}
    evaluated = 1
    last_gain = 0
    for it in range(iterations):
        dcs, caps = state
        moves: list[tuple[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...]]]] = []
        for s in range(problem.n_stages):
            for d in options[s]:
                if d != dcs[s]:
                    nd = list(dcs)
                    nd[s] = d
                    moves.append((("move", s, d), (tuple(nd), caps)))
        # Move a whole run of consecutive stages that share a datacenter (pipelines like to
        # stay together; one stage at a time would have to cross costly split states).
        s = 0
        while s < problem.n_stages:
            e = s
            while e + 1 < problem.n_stages and dcs[e + 1] == dcs[s]:
                e += 1
            if e > s:
                for d in range(problem.n_dcs):
                    if d != dcs[s] and all(d in options[i] for i in range(s, e + 1)):
                        nd = list(dcs)
                        nd[s : e + 1] = [d] * (e - s + 1)
                        moves.append((("run", s, e, d), (tuple(nd), caps)))
            s = e + 1
        for s1, s2 in itertools.combinations(range(problem.n_stages), 2):
            if dcs[s1] != dcs[s2]:
                nd = list(dcs)
                nd[s1], nd[s2] = nd[s2], nd[s1]
                moves.append((("swap", s1, s2), (tuple(nd), caps)))
        for b in range(problem.n_stages - 1):
            for step in (-1, 1):
                c = caps[b] + step
                if 0 <= c <= top and dcs[b] != dcs[b + 1]:
                    nc = list(caps)
                    nc[b] = c
                    moves.append((("cap", b, c), (dcs, tuple(nc))))
        rng.shuffle(moves)
        chosen: (
            tuple[
                tuple[object, ...],
                tuple[tuple[int, ...], tuple[int, ...]],
                tuple[int, tuple[Route | None, ...], bool],
            ]
            | None
        ) = None
        for key, st in moves:
            v = value(st)
            evaluated += 1
            if v is None:
                continue
            if tabu.get(key, -1) >= it and v[0] >= best[0]:
                continue
            if chosen is None or v[0] < chosen[2][0]:
                chosen = (key, st, v)
        if chosen is None:
            break
        key, st, v = chosen
        # Forbid undoing the move for a while.
        if key[0] == "move":
            moved = int(str(key[1]))
            tabu[("move", moved, state[0][moved])] = it + tenure
        else:
            tabu[key] = it + tenure
        state, current = st, v
        if v[2] and v[0] < best[0]:
            best_state, best = st, v
            last_gain = it
        elif it - last_gain >= patience:
            break
    if not best[2]:
        raise Infeasible("tabu: no placement could be routed")
    return PlacementResult(
        Placement(best_state[0], best[1]),
        best[0],
        "tabu",
        time.perf_counter() - t0,
        candidates=evaluated,
    )


def _left_points(
    problem: PlacementProblem, links: Sequence[int], taken: dict[int, set[int]]
) -> list[int]:
    points = {0}
    for lid in links:
        for u in problem.links[lid].busy | taken.get(lid, set()):
            points.add(u + 1)
    return sorted(points)


def pack_exactly(
    problem: PlacementProblem, dcs: Sequence[int], choice: dict[int, tuple[int, int]]
) -> dict[int, int] | None:
    """Start units for every boundary in ``choice`` (boundary -> (path, units)), or None.

    Exhaustive: some solution, if any exists, has every range starting at 0 or right after a
    busy or reserved unit of one of its links (shift each range left as far as it goes), so
    trying those points for every order of boundaries is complete.
    """
    items = sorted(choice)

    def search(left: list[int], taken: dict[int, set[int]]) -> dict[int, int] | None:
        if not left:
            return {}
        for i, b in enumerate(left):
            k, n = choice[b]
            path = problem.paths[(dcs[b], dcs[b + 1])][k]
            limit = min(problem.links[lid].units for lid in path.links)
            for start in _left_points(problem, path.links, taken):
                if start + n > limit:
                    break
                want = set(range(start, start + n))
                if any(
                    want & (problem.links[lid].busy | taken.get(lid, set())) for lid in path.links
                ):
                    continue
                new = {lid: set(taken.get(lid, set())) for lid in taken}
                for lid in path.links:
                    new.setdefault(lid, set()).update(want)
                rest = search(left[:i] + left[i + 1 :], new)
                if rest is not None:
                    return {b: start, **rest}
        return None

    return search(items, {})


def solve_bruteforce(problem: PlacementProblem) -> PlacementResult:
    """Every assignment of stages to datacenters and every route option of every crossing
    boundary; the reference the exact model is tested against (small instances only)."""
    t0 = time.perf_counter()
    options = _feasible_dcs(problem)
    best: tuple[int, tuple[int, ...], tuple[Route | None, ...]] | None = None
    count = 0
    for dcs in itertools.product(*options):
        if not capacity_ok(problem, dcs):
            continue
        cross = [b for b in range(problem.n_stages - 1) if dcs[b] != dcs[b + 1]]
        per_boundary = [
            [
                (k, n)
                for k in range(len(problem.paths.get((dcs[b], dcs[b + 1]), ())))
                for n in problem.levels
            ]
            for b in cross
        ]
        for combo in itertools.product(*per_boundary):
            count += 1
            comm = []
            for b in range(problem.n_stages - 1):
                if dcs[b] == dcs[b + 1]:
                    comm.append(problem.local_us[b][dcs[b]])
                else:
                    k, n = combo[cross.index(b)]
                    comm.append(problem.cross_us(b, dcs[b], dcs[b + 1], k, n))
            value = score(problem, stage_us(problem, dcs, comm))
            if best is not None and value >= best[0]:
                continue
            starts = pack_exactly(problem, dcs, dict(zip(cross, combo, strict=True)))
            if starts is None:
                continue
            routes: list[Route | None] = [None] * (problem.n_stages - 1)
            for b, (k, n) in zip(cross, combo, strict=True):
                routes[b] = Route(k, n, starts[b])
            best = (value, tuple(dcs), tuple(routes))
    if best is None:
        raise Infeasible("no placement satisfies device, path and spectrum constraints")
    return PlacementResult(
        Placement(best[1], best[2]),
        best[0],
        "bruteforce",
        time.perf_counter() - t0,
        optimal=True,
        gap_pct=0.0,
        candidates=count,
    )
