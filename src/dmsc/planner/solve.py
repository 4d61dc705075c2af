"""The planner: strategy search, then network-aware placement, then the plan.

A job that synchronises once per round (diloco, fedavg, fedprox) with more than one island is
placed as islands (:mod:`dmsc.planner.islands`); every other job's stages are placed with their
replicas together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dmsc.netmodel import (
    DEFAULT_CALIBRATION,
    Calibration,
    DoesNotFit,
    Estimate,
    estimate_iteration,
)
from dmsc.planner.gantt import Op, replay_placement, with_tail
from dmsc.planner.island_plan import assemble_island_plan
from dmsc.planner.islands import IslandPlacement, place_islands
from dmsc.planner.placement.baselines import solve_compute_first, solve_greedy, solve_random
from dmsc.planner.placement.from_specs import BuiltProblem, build_problem
from dmsc.planner.placement.milp import solve_milp
from dmsc.planner.placement.problem import (
    Infeasible,
    PlacementProblem,
    PlacementResult,
    score_to_seconds,
)
from dmsc.planner.placement.tabu import solve_tabu
from dmsc.planner.plan import Plan, assemble_plan
from dmsc.planner.recut import rebalanced_job
from dmsc.planner.strategy import StrategySearch, search_strategies
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec

SOLVERS: dict[str, Callable[..., PlacementResult]] = {
    "milp": solve_milp,
    "tabu": solve_tabu,
    "greedy": solve_greedy,
    "compute-first": solve_compute_first,
    "random": solve_random,
}


@dataclass(frozen=True)
class PlanOutcome:
    """A plan and what produced it (for comparisons and drawings)."""

    plan: Plan
    built: BuiltProblem
    result: PlacementResult
    strategy: StrategySearch | None
    searched: JobSpec | None = None  # the strategy before the layers were re-cut

    def iteration_ops(self) -> list[Op]:
        """One iteration as blocks (what ``dmsc plan --gantt`` draws): the replay of the plan's
        schedule (interleaved as it is) on its placement, then the gradient all-reduce and the
        optimizer step."""
        b = self.plan.prediction.breakdown_s
        pb = self.built.problem
        ops = replay_placement(pb, self.result.placement, self.plan.job.schedule)
        return with_tail(ops, pb.n_stages, b.get("dp_comm", 0.0), b.get("optimizer", 0.0))


def run_solver(
    name: str, problem: PlacementProblem, seed: int = 0, time_limit_s: float = 10.0
) -> PlacementResult:
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r} (known: {', '.join(SOLVERS)})")
    if name == "milp":
        return solve_milp(problem, time_limit_s=time_limit_s, seed=seed)
    if name in ("tabu", "random"):
        return SOLVERS[name](problem, seed=seed)
    return SOLVERS[name](problem)


def choose_strategy(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    devices: int | None,
    fixed: bool,
    top_k: int = 5,
    calib: Calibration = DEFAULT_CALIBRATION,
    progress: Callable[[int], None] | None = None,
) -> tuple[JobSpec, StrategySearch | None]:
    """The job itself when its strategy is fixed, else the best found by the search."""
    if fixed:
        return job, None
    n = devices if devices is not None else cluster.device_count
    if n > cluster.device_count:
        raise DoesNotFit([f"asked for {n} devices, the cluster has {cluster.device_count}"])
    biggest = max(
        sum(g.count * cluster.node_types[g.type].devices for g in dc.nodes)
        for dc in cluster.datacenters
    )
    cap = biggest if len(cluster.datacenters) > 1 else None
    search = search_strategies(cluster, model, job, n, top_k, calib, cap, progress)
    return search.best.job, search


def plan_job(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    solver: str = "milp",
    devices: int | None = None,
    fixed: bool = False,
    seed: int = 0,
    time_limit_s: float = 10.0,
    top_k: int = 5,
    calib: Calibration = DEFAULT_CALIBRATION,
    progress: Callable[[int], None] | None = None,
    k_paths: int = 2,
) -> PlanOutcome:
    """Plan ``job``: search its strategy (unless ``fixed``), place it, and assemble the plan.

    Raises :class:`DoesNotFit` or :class:`Infeasible` with the binding constraint.
    """
    chosen, search = choose_strategy(cluster, model, job, devices, fixed, top_k, calib, progress)
    return place_job(
        cluster, model, chosen, search, solver, seed, time_limit_s, calib, k_paths=k_paths
    )


def place_job(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    chosen: JobSpec,
    search: StrategySearch | None,
    solver: str = "milp",
    seed: int = 0,
    time_limit_s: float = 10.0,
    calib: Calibration = DEFAULT_CALIBRATION,
    k_paths: int = 2,
) -> PlanOutcome:
    """Place the strategy ``chosen`` with ``solver``, re-cut its layers for the placement, and
    assemble the plan: what ``plan_job`` does once the strategy is known (``--compare`` runs it
    once per solver, so that each row is the plan ``--solver`` would give)."""
    searched = chosen
    if chosen.devices > cluster.device_count:
        raise DoesNotFit(
            [f"needs {chosen.devices} devices, the cluster has {cluster.device_count}"]
        )
    if chosen.sync.local_steps and chosen.dp > chosen.ep:
        return _place_islands(
            cluster, model, chosen, search, solver, seed, time_limit_s, calib, k_paths
        )
    estimate = estimate_iteration(cluster, model, chosen, calib)
    built = build_problem(cluster, model, chosen, k_paths=k_paths, calib=calib)
    if all(c is None for row in built.problem.compute_us for c in row):
        raise Infeasible("no datacenter's devices can hold a stage (memory)")
    result = run_solver(solver, built.problem, seed, time_limit_s)
    # Re-cut the layers for the placed pipeline (exact DP) and keep the faster of the two.
    better = rebalanced_job(cluster, model, chosen, built, result, calib)
    if better is not None:
        try:
            built2 = build_problem(cluster, model, better, k_paths=k_paths, calib=calib)
            result2 = run_solver(solver, built2.problem, seed, time_limit_s)
            if score_to_seconds(built2.problem, result2.objective) < score_to_seconds(
                built.problem, result.objective
            ):
                chosen, built, result = better, built2, result2
                estimate = estimate_iteration(cluster, model, chosen, calib)
        except (DoesNotFit, Infeasible):
            pass
    plan = assemble_plan(cluster, model, chosen, built, result, estimate, search, calib)
    return PlanOutcome(plan, built, result, search, searched)


def _place_islands(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    chosen: JobSpec,
    search: StrategySearch | None,
    solver: str,
    seed: int,
    time_limit_s: float,
    calib: Calibration,
    k_paths: int,
) -> PlanOutcome:
    """:func:`place_job` for a round mode's islands: placed, the layers re-cut for the slowest
    island's pipeline (kept when faster, as for a pipeline), and the plan assembled. The
    outcome's problem and placement are the slowest island's (what ``--gantt`` draws)."""
    searched = chosen

    def solve(problem: PlacementProblem) -> PlacementResult:
        return run_solver(solver, problem, seed, time_limit_s)

    def place(job: JobSpec) -> tuple[IslandPlacement, Estimate]:
        estimate = estimate_iteration(cluster, model, job, calib)
        optimizer_s = estimate.breakdown_s["optimizer"]
        placed = place_islands(cluster, model, job, solve, solver, optimizer_s, calib, k_paths)
        return placed, estimate

    placed, estimate = place(chosen)
    crit = placed.critical
    better = rebalanced_job(cluster, model, placed.job, crit.built, crit.result, calib)
    if better is not None:
        recut = JobSpec.model_validate({**chosen.model_dump(), "stage_layers": better.stage_layers})
        try:
            placed2, estimate2 = place(recut)
            if placed2.iteration_s < placed.iteration_s:
                chosen, placed, estimate = recut, placed2, estimate2
        except (DoesNotFit, Infeasible):
            pass
    plan = assemble_island_plan(cluster, model, chosen, placed, estimate, search)
    crit = placed.critical
    return PlanOutcome(plan, crit.built, placed.result, search, searched)
