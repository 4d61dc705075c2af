"""The exact placement model, solved with OR-Tools CP-SAT.

Stage placement, path choice, capacity level and the exact spectrum range of every crossing
boundary are decided together: one optional interval per (boundary, datacenter pair, path,
level) whose start is the first unit of its range, placed on every link of its path under a
no-overlap constraint with the other ranges and the busy units (continuity and contiguity by
construction). The objective is the integer score of :mod:`dmsc.planner.placement.problem`, so the
answer is comparable with brute force to the microsecond.
"""

from __future__ import annotations

import time

from ortools.sat.python import cp_model

from dmsc.planner.placement.baselines import solve_greedy
from dmsc.planner.placement.problem import (
    Infeasible,
    Placement,
    PlacementProblem,
    PlacementResult,
    Reservation,
)
from dmsc.planner.placement.routing import feasible_dcs


def _busy_runs(busy: frozenset[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for u in sorted(busy):
        if runs and runs[-1][0] + runs[-1][1] == u:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((u, 1))
    return runs


def solve_milp(
    problem: PlacementProblem,
    time_limit_s: float = 10.0,
    workers: int = 2,
    seed: int = 0,
) -> PlacementResult:
    """Optimal placement (or the best found within ``time_limit_s``, with its gap)."""
    t0 = time.perf_counter()
    options = feasible_dcs(problem)
    P, D = problem.n_stages, problem.n_dcs
    model = cp_model.CpModel()
    x = [[model.new_bool_var(f"x{s}_{d}") for d in range(D)] for s in range(P)]
    for s in range(P):
        for d in range(D):
            if d not in options[s]:
                model.add(x[s][d] == 0)
        model.add_exactly_one(x[s])
    for d in range(D):
        model.add(sum(problem.devices[s] * x[s][d] for s in range(P)) <= problem.free_devices[d])

    link_intervals: dict[int, list[cp_model.IntervalVar]] = {}
    choices: dict[tuple[int, int, int, int, int], tuple[cp_model.IntVar, cp_model.IntVar]] = {}
    boundary_terms: list[list[tuple[cp_model.IntVar, int]]] = []
    crossing: list[cp_model.LinearExpr] = []  # 1 when boundary b changes datacenter
    max_cross = 0
    for b in range(P - 1):
        terms: list[tuple[cp_model.IntVar, int]] = []
        for a in options[b]:
            for z in options[b + 1]:
                if a == z:
                    same = model.new_bool_var(f"same{b}_{a}")
                    model.add_implication(same, x[b][a])
                    model.add_implication(same, x[b + 1][a])
                    model.add_bool_or([x[b][a].Not(), x[b + 1][a].Not(), same])
                    terms.append((same, problem.local_us[b][a]))
                    continue
                pair = []
                for k, path in enumerate(problem.paths.get((a, z), ())):
                    limit = min(problem.links[lid].units for lid in path.links)
                    for n in problem.levels:
                        if n > limit:
                            continue
                        y = model.new_bool_var(f"y{b}_{a}_{z}_{k}_{n}")
                        start = model.new_int_var(0, limit - n, f"start{b}_{a}_{z}_{k}_{n}")
                        iv = model.new_optional_fixed_size_interval_var(
                            start, n, y, f"iv{b}_{a}_{z}_{k}_{n}"
                        )
                        for lid in path.links:
                            link_intervals.setdefault(lid, []).append(iv)
                        cost = problem.cross_us(b, a, z, k, n)
                        max_cross = max(max_cross, cost)
                        terms.append((y, cost))
                        pair.append(y)
                        choices[(b, a, z, k, n)] = (y, start)
                if not pair:
                    model.add_bool_or([x[b][a].Not(), x[b + 1][z].Not()])
                    continue
                model.add(sum(pair) <= x[b][a])
                model.add(sum(pair) <= x[b + 1][z])
                model.add(sum(pair) >= x[b][a] + x[b + 1][z] - 1)
        boundary_terms.append(terms)
        crossing.append(
            cp_model.LinearExpr.sum([v for (bb, *_), (v, _) in choices.items() if bb == b])
        )
    for lid, ivs in link_intervals.items():
        fixed = [
            model.new_fixed_size_interval_var(s0, length, f"busy{lid}_{s0}")
            for s0, length in _busy_runs(problem.links[lid].busy)
        ]
        model.add_no_overlap(ivs + fixed)

    max_compute = max(c for row in problem.compute_us for c in row if c is not None)
    max_local = max((u for row in problem.local_us for u in row), default=0)
    horizon = max_compute + 2 * max(max_cross, max_local)
    comm = []
    for b, terms in enumerate(boundary_terms):
        c = model.new_int_var(0, max(max_cross, max_local), f"comm{b}")
        model.add(c == sum(v * w for v, w in terms))
        comm.append(c)
    t = []
    comps: list[cp_model.LinearExprT] = []
    for s in range(P):
        ts = model.new_int_var(0, horizon, f"t{s}")
        comp = sum(x[s][d] * (problem.compute_us[s][d] or 0) for d in options[s])
        comps.append(comp)
        if s > 0:
            model.add(ts >= comp + 2 * comm[s - 1])
        if s < P - 1:
            model.add(ts >= comp + 2 * comm[s])
        model.add(ts >= comp)
        t.append(ts)
    T = model.new_int_var(0, horizon, "T")
    model.add_max_equality(T, t)
    # Redundant cuts that tighten the relaxation (both hold for every solution):
    # t_s >= comp_s + comm_{s-1} + comm_s, summed over stages;
    model.add(
        cp_model.LinearExpr.sum(t)
        >= cp_model.LinearExpr.sum(comps) + 2 * cp_model.LinearExpr.sum(comm)
    )
    # and when the stages need more devices than the largest datacenters hold, at least
    # (datacenters needed - 1) boundaries cross.
    need, room, used = sum(problem.devices), 0, 0
    for f in sorted(problem.free_devices, reverse=True):
        if room >= need:
            break
        room += f
        used += 1
    if used > 1:
        model.add(sum(crossing) >= used - 1)
        # Some boundary crosses, so the slowest stage waits at least the cheapest crossing.
        costs = [problem.cross_us(b, a, z, k, n) for (b, a, z, k, n) in choices]
        fastest = min(c for row in problem.compute_us for c in row if c is not None)
        if costs:  # (with no crossing option at all the model is already infeasible)
            model.add(fastest + 2 * min(costs) <= T)
        # Every datacenter in use then has a crossing boundary at its edge, at least as slow as
        # the cheapest option that touches it.
        for d in range(D):
            touching = [
                problem.cross_us(b, a, z, k, n) for (b, a, z, k, n) in choices if d in (a, z)
            ]
            if not touching:
                continue
            u = model.new_bool_var(f"used{d}")
            for s in range(P):
                model.add_implication(x[s][d], u)
            model.add(u <= sum(x[s][d] for s in range(P)))
            model.add(fastest + 2 * min(touching) * u <= T)
    v, m = problem.chunks, problem.microbatches
    model.minimize(v * P * m * T + (P - 1) * sum(t))

    try:  # a greedy start helps the search; not needed for correctness
        hint = solve_greedy(problem).placement
        for s in range(P):
            for d in range(D):
                model.add_hint(x[s][d], int(hint.dcs[s] == d))
    except Infeasible:
        pass

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        raise Infeasible("no placement satisfies device, path and spectrum constraints")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise Infeasible(f"the solver found no placement within {time_limit_s:g} s")
    dcs = tuple(next(d for d in range(D) if solver.value(x[s][d])) for s in range(P))
    routes: list[Reservation | None] = [None] * (P - 1)
    for (b, _a, _z, k, n), (y, start) in choices.items():
        if solver.value(y):
            routes[b] = Reservation(k, n, int(solver.value(start)))
    objective = round(solver.objective_value)
    bound = solver.best_objective_bound
    gap = 0.0 if status == cp_model.OPTIMAL else max(0.0, (objective - bound) / objective * 100)
    return PlacementResult(
        Placement(dcs, tuple(routes)),
        objective,
        "milp",
        time.perf_counter() - t0,
        optimal=status == cp_model.OPTIMAL,
        gap_pct=gap,
        candidates=int(solver.num_branches),
    )
