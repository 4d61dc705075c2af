"""Placement solvers against brute force on seeded random small instances, and the planner's
network awareness and speed on the example clusters.

Prints tables, or with --json one object: ``instances``, ``milp_equals_bruteforce``, ``gap_pct``
(per solver: ``mean``, ``max``, ``blocked``), ``network_awareness`` and ``speed``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dmsc.planner.placement import (
    solve_bruteforce,
    solve_compute_first,
    solve_greedy,
    solve_random,
    solve_tabu,
)
from dmsc.planner.placement.from_specs import build_problem
from dmsc.planner.placement.instance_generator import random_problem
from dmsc.planner.placement.milp import solve_milp
from dmsc.planner.placement.problem import Infeasible, score_to_seconds
from dmsc.planner.solve import plan_job
from dmsc.planner.strategy import search_strategies
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[1]
HEURISTICS = {
    "tabu": solve_tabu,
    "greedy": solve_greedy,
    "compute-first": solve_compute_first,
    "random": solve_random,
}


def optimality(n: int) -> dict:
    gaps: dict[str, list[float]] = {name: [] for name in HEURISTICS}
    blocked = dict.fromkeys(HEURISTICS, 0)
    equal = 0
    used = 0
    seed = 0
    sizes = []
    while used < n:
        p = random_problem(seed)
        seed += 1
        try:
            exact = solve_bruteforce(p)
        except Infeasible:
            continue
        used += 1
        sizes.append((p.n_dcs, p.n_stages))
        milp = solve_milp(p)
        equal += milp.objective == exact.objective
        for name, solve in HEURISTICS.items():
            try:
                r = solve(p)
            except Infeasible:
                blocked[name] += 1
                continue
            gaps[name].append((r.objective / exact.objective - 1) * 100)
    return {
        "instances": used,
        "max_dcs": max(d for d, _ in sizes),
        "max_stages": max(s for _, s in sizes),
        "milp_equals_bruteforce": equal == used,
        "milp_equal_count": equal,
        "gap_pct": {
            name: {
                "mean": statistics.fmean(g) if g else None,
                "max": max(g) if g else None,
                "blocked": blocked[name],
            }
            for name, g in gaps.items()
        },
    }


def network_awareness() -> dict:
    """Two scenarios on nsfnet-4dc that must span all four datacenters (1024 devices): the
    strategy the planner chooses for the issue's command, and a fixed 16-stage pipeline."""
    cluster = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "nsfnet-4dc.yaml")
    model = resolve_model("llama3-70b")
    searched = plan_job(cluster, model, JobSpec(global_batch=512)).plan.job
    fixed = JobSpec(
        global_batch=512, tp=8, pp=16, dp=8, recompute="selective", sequence_parallel=True
    )
    return {
        f"searched strategy (tp={searched.tp} pp={searched.pp} dp={searched.dp})": _aware(
            cluster, model, searched
        ),
        "fixed 16 stages (tp=8 pp=16 dp=8)": _aware(cluster, model, fixed),
    }


def _aware(cluster: ClusterSpec, model: TransformerSpec, job: JobSpec) -> dict:
    built = build_problem(cluster, model, job)
    out = {}
    for name, solve in (
        ("milp", solve_milp),
        ("tabu", solve_tabu),
        ("greedy", solve_greedy),
        ("compute-first", solve_compute_first),
    ):
        r = solve(built.problem)
        out[name] = {
            "pipeline_s": score_to_seconds(built.problem, r.objective),
            "seconds": r.seconds,
            "optimal": r.optimal,
        }
    base = out["compute-first"]["pipeline_s"]
    for name in ("milp", "tabu"):
        out[name]["shorter_than_compute_first_pct"] = (1 - out[name]["pipeline_s"] / base) * 100
    return out


def speed() -> dict:
    selene = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "a100-selene.yaml")
    t0 = time.perf_counter()
    search = search_strategies(selene, resolve_model("gpt3-175b"), JobSpec(global_batch=1536), 1024)
    strategy_s = time.perf_counter() - t0
    nsf = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "nsfnet-4dc.yaml")
    job = JobSpec(
        global_batch=512, tp=8, pp=16, dp=8, recompute="selective", sequence_parallel=True
    )
    built = build_problem(nsf, resolve_model("llama3-70b"), job)
    placement = solve_milp(built.problem)
    t0 = time.perf_counter()
    outcome = plan_job(nsf, resolve_model("llama3-70b"), job, "milp", fixed=True)
    plan_s = time.perf_counter() - t0
    return {
        "gpt3_175b_1024_gpus_strategy_search_s": strategy_s,
        "strategies_considered": search.considered,
        "milp_16_stages_4_dcs_s": placement.seconds,
        "milp_optimal": placement.optimal,
        "plan_16_stages_with_recut_s": plan_s,
        "plan_optimal": outcome.result.optimal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--instances", type=int, default=50)
    args = parser.parse_args()
    result = {
        **optimality(args.instances),
        "network_awareness": network_awareness(),
        "speed": speed(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{result['instances']} instances (up to {result['max_dcs']} datacenters, "
        f"{result['max_stages']} stages): milp equals brute force on "
        f"{result['milp_equal_count']}/{result['instances']}"
    )
    print(f"{'solver':15s} {'mean gap':>9s} {'max gap':>9s} {'blocked':>8s}")
    for name, g in result["gap_pct"].items():
        mean = f"{g['mean']:.2f}%" if g["mean"] is not None else "-"
        worst = f"{g['max']:.2f}%" if g["max"] is not None else "-"
        print(f"{name:15s} {mean:>9s} {worst:>9s} {g['blocked']:>8d}")
    for scenario, rows in result["network_awareness"].items():
        print(f"\nnsfnet-4dc, llama3-70b, {scenario}: pipeline time per iteration")
        for name, r in rows.items():
            extra = r.get("shorter_than_compute_first_pct")
            tail = f"  {extra:.1f}% shorter than compute-first" if extra is not None else ""
            print(f"  {name:15s} {r['pipeline_s']:8.3f} s  (solved in {r['seconds']:.2f} s){tail}")
    s = result["speed"]
    search_s = s["gpt3_175b_1024_gpus_strategy_search_s"]
    print(
        f"\nstrategy search, GPT-3 175B on 1024 GPUs: {search_s:.2f} s"
        f" ({s['strategies_considered']} strategies)"
    )
    print(
        f"milp placement, 16 stages over 4 datacenters: {s['milp_16_stages_4_dcs_s']:.2f} s "
        f"(optimal: {s['milp_optimal']}); whole plan with the layer re-cut and second "
        f"placement: {s['plan_16_stages_with_recut_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
