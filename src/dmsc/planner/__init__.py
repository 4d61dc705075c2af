"""The planner: segmentation, strategy search and network-aware placement, pure code.

Specs and the cost model in, a :class:`Plan` out (the contract with the runtime and the
simulator). Imports only :mod:`dmsc.spec` and :mod:`dmsc.netmodel`; no I/O, no clock.

The names below load on first use (PEP 562): the control plane reads a plan without loading
the solvers (OR-Tools, networkx: 0.7 s of every ``dmsc up``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmsc._lazy import lazy_getattr

if TYPE_CHECKING:
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
    from dmsc.planner.plan import (
        PLAN_VERSION,
        Plan,
    )
    from dmsc.planner.segmentation.cuts import (
        SegmentationInfeasible,
        segment_blocks_exact,
        segment_blocks_tabu,
        segment_business,
        segment_layers,
    )
    from dmsc.planner.solve import (
        SOLVERS,
        PlanOutcome,
        plan_job,
        run_solver,
    )
    from dmsc.planner.strategy import (
        StrategySearch,
        search_strategies,
    )

_WHERE = {
    "Infeasible": "dmsc.planner.placement.problem",
    "LinkState": "dmsc.planner.placement.problem",
    "PLAN_VERSION": "dmsc.planner.plan",
    "PathOption": "dmsc.planner.placement.problem",
    "Placement": "dmsc.planner.placement.problem",
    "PlacementProblem": "dmsc.planner.placement.problem",
    "PlacementResult": "dmsc.planner.placement.problem",
    "Plan": "dmsc.planner.plan",
    "PlanOutcome": "dmsc.planner.solve",
    "Reservation": "dmsc.planner.placement.problem",
    "SOLVERS": "dmsc.planner.solve",
    "SegmentationInfeasible": "dmsc.planner.segmentation.cuts",
    "StrategySearch": "dmsc.planner.strategy",
    "evaluate": "dmsc.planner.placement.problem",
    "plan_job": "dmsc.planner.solve",
    "run_solver": "dmsc.planner.solve",
    "search_strategies": "dmsc.planner.strategy",
    "segment_blocks_exact": "dmsc.planner.segmentation.cuts",
    "segment_blocks_tabu": "dmsc.planner.segmentation.cuts",
    "segment_business": "dmsc.planner.segmentation.cuts",
    "segment_layers": "dmsc.planner.segmentation.cuts",
}


__getattr__ = lazy_getattr(_WHERE, globals())


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
