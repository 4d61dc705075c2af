"""The control layer: the planner (segmentation, strategy search, network-aware placement)."""

from dmsc.control.plan import PLAN_VERSION, Plan
from dmsc.control.planner import SOLVERS, PlanOutcome, plan_job, run_solver
from dmsc.control.problem import (
    Infeasible,
    LinkState,
    PathOption,
    Placement,
    PlacementProblem,
    PlacementResult,
    Route,
    evaluate,
)
from dmsc.control.segment import (
    SegmentationInfeasible,
    segment_blocks_exact,
    segment_blocks_tabu,
    segment_business,
    segment_layers,
)
from dmsc.control.strategy import StrategySearch, search_strategies

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
    "Route",
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
