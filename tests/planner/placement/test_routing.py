"""The routing step the heuristics share, against a plain reference: every (path, units) option
of every crossing boundary tried first-fit, the fastest that fits kept (ties: the first)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from dmsc.planner.placement.instance_generator import random_problem
from dmsc.planner.placement.problem import (
    PlacementProblem,
    Reservation,
    boundary_us,
    first_fit,
    reserve,
)
from dmsc.planner.placement.routing import route_first_fit, route_with_times


def _reference(
    problem: PlacementProblem,
    dcs: Sequence[int],
    caps: Sequence[int] | None,
    fixed_units: int | None,
    shortest_only: bool,
) -> tuple[tuple[Reservation | None, ...], list[int]]:
    taken: dict[int, int] = {}
    routes: list[Reservation | None] = []
    failed: list[int] = []
    for b in range(problem.n_stages - 1):
        a, z = dcs[b], dcs[b + 1]
        if a == z:
            routes.append(None)
            continue
        options = problem.paths.get((a, z), ())[: 1 if shortest_only else None]
        levels = problem.levels if caps is None else problem.levels[: caps[b] + 1]
        if fixed_units is not None:
            levels = (fixed_units,)
        best: tuple[int, Reservation] | None = None
        for k, path in enumerate(options):
            for n in levels:
                start = first_fit(problem, path, n, taken)
                if start is not None:
                    t = problem.cross_us(b, a, z, k, n)
                    if best is None or t < best[0]:
                        best = (t, Reservation(k, n, start))
        if best is None:
            failed.append(b)
            routes.append(None)
            continue
        reserve(options[best[1].path], best[1].start, best[1].units, taken)
        routes.append(best[1])
    return tuple(routes), failed


@pytest.mark.parametrize("seed", range(40))
def test_routing_matches_the_reference(seed: int) -> None:
    problem = random_problem(seed)
    rng = random.Random(seed)
    for _ in range(25):
        dcs = [rng.randrange(problem.n_dcs) for _ in range(problem.n_stages)]
        caps = [rng.randrange(len(problem.levels)) for _ in range(problem.n_stages - 1)]
        for args in (
            (None, None, False),
            (caps, None, False),
            (None, None, True),
            (None, problem.levels[0], True),
        ):
            got = route_first_fit(problem, dcs, *args)
            assert got == _reference(problem, dcs, *args)
            routes, failed, comm = route_with_times(problem, dcs, *args, unrouted_us=-1)
            if not failed:
                assert comm == boundary_us(problem, dcs, routes)
            assert [b for b, c in enumerate(comm) if c == -1] == failed
