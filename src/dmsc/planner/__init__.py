"""The planner: segmentation, strategy search and network-aware placement, pure code.

Specs and the cost model in, a :class:`Plan` out (the contract with the runtime and the
simulator). Imports only :mod:`dmsc.spec` and :mod:`dmsc.netmodel`; no I/O, no clock.
"""

from dmsc.planner.placement.problem import (
    Infeasible,
    LinkState,
    PathOption,
    Placement,
    PlacementProblem,
    PlacementResult,
    Reservation,
    evaluate,
)
from dmsc.planner.plan import PLAN_VERSION, Plan
from dmsc.planner.segmentation.cuts import (
    SegmentationInfeasible,
    segment_blocks_exact,
    segment_blocks_tabu,
    segment_business,
    segment_layers,
)
from dmsc.planner.solve import SOLVERS, PlanOutcome, plan_job, run_solver
from dmsc.planner.strategy import StrategySearch, search_strategies

__all__ = [
    "PLAN_VERSION",
    "SOLVERS",
    "Infeasible",
    "LinkState",
    "PathOption",
    "Placement",
    "PlacementProblem",
    "PlacementResult",
    "Plan",
    "PlanOutcome",
    "Reservation",
    "SegmentationInfeasible",
    "StrategySearch",
    "evaluate",
    "plan_job",
    "run_solver",
    "search_strategies",
    "segment_blocks_exact",
    "segment_blocks_tabu",
    "segment_business",
    "segment_layers",
]
