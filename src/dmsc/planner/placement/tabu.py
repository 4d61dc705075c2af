"""Tabu search over placements (stage moves, runs of stages, swaps, capacity caps), from the
greedy placement and seeded random starts; spectrum is reserved first-fit."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

from dmsc.planner.placement.baselines import solve_greedy, solve_random
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
from dmsc.planner.placement.routing import feasible_dcs, route_with_times


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
    options = feasible_dcs(problem)
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

    seen: dict[
        tuple[tuple[int, ...], tuple[int, ...]],
        tuple[int, tuple[Reservation | None, ...], bool] | None,
    ] = {}

    def value(
        st: tuple[tuple[int, ...], tuple[int, ...]],
    ) -> tuple[int, tuple[Reservation | None, ...], bool] | None:
        """The state's score (a pure function of it: neighbourhoods overlap, so it is kept)."""
        if st not in seen:
            seen[st] = _value(st)
        return seen[st]

    def _value(
        st: tuple[tuple[int, ...], tuple[int, ...]],
    ) -> tuple[int, tuple[Reservation | None, ...], bool] | None:
        dcs, caps = st
        if not capacity_ok(problem, dcs):
            return None
        routes, failed, comm = route_with_times(problem, dcs, caps, None, False, penalty)
        return score(problem, stage_us(problem, dcs, comm)), routes, not failed

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
                tuple[int, tuple[Reservation | None, ...], bool],
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
