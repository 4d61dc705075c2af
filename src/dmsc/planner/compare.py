"""Every placement solver on one chosen strategy, side by side (``dmsc plan --compare``).

Each solver gets what ``dmsc plan --solver NAME`` does with the same strategy: its own placement,
the layers re-cut for it, its own plan, so each row's iteration time is that plan's. A solver that
finds no placement gives a blocked row with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dmsc.netmodel import DoesNotFit
from dmsc.planner.placement.problem import Infeasible
from dmsc.planner.plan import pipeline_seconds
from dmsc.planner.solve import SOLVERS, PlanOutcome, place_job
from dmsc.spec import ClusterSpec, LayerListSpec, TransformerSpec


@dataclass(frozen=True)
class SolverRow:
    """One solver's plan of the strategy: its iteration and pipeline seconds, its placement
    time and optimality gap; or blocked, with the reason."""

    solver: str
    blocked: bool
    reason: str = ""
    iteration_s: float = 0.0
    pipeline_s: float = 0.0
    seconds: float = 0.0
    optimal: bool = False
    gap_pct: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """As ``dmsc plan --compare --json`` prints it."""
        if self.blocked:
            return {"solver": self.solver, "blocked": True, "reason": self.reason}
        return {
            "solver": self.solver,
            "iteration_s": self.iteration_s,
            "pipeline_s": self.pipeline_s,
            "seconds": self.seconds,
            "optimal": self.optimal,
            "gap_pct": self.gap_pct,
            "blocked": False,
        }


def compare_solvers(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    outcome: PlanOutcome,
    chosen: str,
    seed: int = 0,
    time_limit_s: float = 10.0,
    k_paths: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[SolverRow]:
    """Every solver of :data:`SOLVERS` on ``outcome``'s strategy; ``chosen`` (the solver that
    made ``outcome``) is not run again."""
    searched = outcome.searched or outcome.plan.job
    rows = []
    for name in SOLVERS:
        if progress is not None:
            progress(name)
        try:
            other = (
                outcome
                if name == chosen
                else place_job(
                    cluster, model, searched, outcome.strategy, name, seed, time_limit_s,
                    k_paths=k_paths,
                )
            )  # fmt: skip
        except (DoesNotFit, Infeasible) as exc:
            why = exc.reasons[0] if isinstance(exc, DoesNotFit) else str(exc)
            rows.append(SolverRow(name, blocked=True, reason=why))
            continue
        search = other.plan.search
        rows.append(
            SolverRow(
                name,
                blocked=False,
                iteration_s=other.plan.prediction.iteration_time_s,
                pipeline_s=pipeline_seconds(other.plan),
                seconds=search.placement_seconds,
                optimal=search.optimal,
                gap_pct=search.gap_pct,
            )
        )
    return rows
