"""The reference solver: every placement, path and capacity level, with an exact packing of the
slot ranges (left-justified backtracking). Exponential: for small instances and tests."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from dmsc.planner.placement.problem import (
    Infeasible,
    Placement,
    PlacementProblem,
    PlacementResult,
    Reservation,
    capacity_ok,
    score,
    stage_us,
)
from dmsc.planner.placement.routing import feasible_dcs


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
    options = feasible_dcs(problem)
    best: tuple[int, tuple[int, ...], tuple[Reservation | None, ...]] | None = None
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
            routes: list[Reservation | None] = [None] * (problem.n_stages - 1)
            for b, (k, n) in zip(cross, combo, strict=True):
                routes[b] = Reservation(k, n, starts[b])
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
