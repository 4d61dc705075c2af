"""The exact placement model, solved with OR-Tools CP-SAT.

Stage placement, path choice, capacity level and the exact spectrum range of every crossing
boundary are decided together: one optional interval per (boundary, datacenter pair, path,
level) whose start is the first unit of its range, placed on every link of its path under a
no-overlap constraint with the other ranges and the busy units (continuity and contiguity by
construction). The objective is the integer score of :mod:`dmsc.planner.placement.problem`, so the
answer is comparable with brute force to the microsecond.

CP-SAT's parallel workers race, so of several placements with the best score any could come back.
When the score is proved optimal, two more short solves make the answer the same on every run and
the one brute force gives: the score held, the datacenters of the stages are made least in
order (stage 0 first), then, with those fixed, the route of every crossing (path, then units) and
then its first unit. The keys are exact lexicographic orders while they fit in 62 bits (up to 31
stages on 4 datacenters), plain sums beyond.
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
    objective_expr = v * P * m * T + (P - 1) * sum(t)
    model.minimize(objective_expr)

    try:  # a greedy start helps the search; not needed for correctness
        hint = solve_greedy(problem).placement
        for s in range(P):
            for d in range(D):
                model.add_hint(x[s][d], int(hint.dcs[s] == d))
    except Infeasible:
        pass

    solver = _solver(time_limit_s, workers, seed)
    status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        raise Infeasible("no placement satisfies device, path and spectrum constraints")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise Infeasible(f"the solver found no placement within {time_limit_s:g} s")
    objective = round(solver.objective_value)
    bound = solver.best_objective_bound
    optimal = status == cp_model.OPTIMAL
    branches = int(solver.num_branches)
    dcs = tuple(next(d for d in range(D) if solver.value(x[s][d])) for s in range(P))
    picked = {
        key: (int(solver.value(y)), int(solver.value(st))) for key, (y, st) in choices.items()
    }
    if optimal:
        model.add(objective_expr <= objective)
        # 1. the least datacenters, stage by stage
        left = time_limit_s - (time.perf_counter() - t0)
        if left > 0:
            weights = _lex_weights([D] * P)
            _hint(model, x, dcs, choices, picked)
            model.minimize(sum(weights[s] * d * x[s][d] for s in range(P) for d in options[s]))
            tie = _solver(left, workers, seed)
            if tie.solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                branches += int(tie.num_branches)
                dcs = tuple(next(d for d in range(D) if tie.value(x[s][d])) for s in range(P))
                picked = {
                    k: (int(tie.value(y)), int(tie.value(st))) for k, (y, st) in choices.items()
                }
        # 2. those kept, the least routes of the crossings in order, then their first units
        left = time_limit_s - (time.perf_counter() - t0)
        cross = [b for b in range(P - 1) if dcs[b] != dcs[b + 1]]
        if left > 0 and cross:
            for s in range(P):
                model.add(x[s][dcs[s]] == 1)
            n_paths = max((len(opts) for opts in problem.paths.values()), default=1)
            options_kn = [(k, n) for k in range(n_paths) for n in problem.levels]
            rank = {kn: r for r, kn in enumerate(options_kn)}
            units = 1 + max(lk.units for lk in problem.links)
            route_w = _lex_weights([len(rank)] * len(cross))
            start_w = _lex_weights([units] * len(cross))
            route_terms, start_terms = [], []
            for i, b in enumerate(cross):
                for (bb, a, z, k, n), (y, st) in choices.items():
                    if (bb, a, z) == (b, dcs[b], dcs[b + 1]):
                        route_terms.append(route_w[i] * rank[(k, n)] * y)
                        start_terms.append(start_w[i] * st)
            span = sum(w * (units - 1) for w in start_w) + 1
            route_span = sum(w * (len(rank) - 1) for w in route_w) + 1
            scale = span if span * route_span < 2**62 else 1
            _hint(model, x, dcs, choices, picked)
            model.minimize(scale * sum(route_terms) + sum(start_terms))
            tie = _solver(left, workers, seed)
            if tie.solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                branches += int(tie.num_branches)
                picked = {
                    k: (int(tie.value(y)), int(tie.value(st))) for k, (y, st) in choices.items()
                }
    routes: list[Reservation | None] = [None] * (P - 1)
    for (b, _a, _z, k, n), (chosen, first) in picked.items():
        if chosen:
            routes[b] = Reservation(k, n, first)
    gap = 0.0 if optimal else max(0.0, (objective - bound) / objective * 100)
    return PlacementResult(
        Placement(dcs, tuple(routes)),
        objective,
        "milp",
        time.perf_counter() - t0,
        optimal=optimal,
        gap_pct=gap,
        candidates=branches,
    )


def _solver(time_limit_s: float, workers: int, seed: int) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    return solver


def _lex_weights(sizes: list[int]) -> list[int]:
    """Weights that order values ``v_i < sizes[i]`` lexicographically (first most significant)
    by ``sum(w_i * v_i)``; all 1 when that would not fit in 62 bits."""
    weights = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        weights[i] = weights[i + 1] * max(1, sizes[i + 1])
    if weights and weights[0] * max(1, sizes[0]) >= 2**62:
        return [1] * len(sizes)
    return weights


def _hint(
    model: cp_model.CpModel,
    x: list[list[cp_model.IntVar]],
    dcs: tuple[int, ...],
    choices: dict[tuple[int, int, int, int, int], tuple[cp_model.IntVar, cp_model.IntVar]],
    picked: dict[tuple[int, int, int, int, int], tuple[int, int]],
) -> None:
    """Start the next solve from the placement found (it is a solution of the next model)."""
    model.clear_hints()  # type: ignore[no-untyped-call]
    for s, row in enumerate(x):
        for d, var in enumerate(row):
            model.add_hint(var, int(dcs[s] == d))
    for key, (y, st) in choices.items():
        model.add_hint(y, picked[key][0])
        model.add_hint(st, picked[key][1])
