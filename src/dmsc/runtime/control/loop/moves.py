"""Applying a move the orchestrator accepted: the deployment goes to the re-planned placement.

Shared by ``dmsc replan`` (:mod:`..replanning`) and the control loop (:mod:`.runner`); the
caller holds the control plane's task lock (between training tasks). The move re-plans on the
measured figures again (the same re-plan the proposal came from) and moves the deployment to
that plan from a checkpoint (``relayout``: the workers stop and start where the plan puts them;
weights and AdamW state carry over). Only a move that keeps each stage's layers is applied: a
re-cut changes which stage holds which layers, and the per-stage checkpoint does not carry over
(refused, with the reason), and so is one that would put a stage where a residency rule of the
cluster spec keeps the model's weights out (naming the rule).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from dmsc.data.traces import StepTrace
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.base import Proposal
from dmsc.runtime.control.advisors.paths import replan
from dmsc.runtime.control.training.residency import check_move
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec


class Movable(Protocol):
    """What a move reads of the control plane, and the one thing it asks of it."""

    plan: Plan
    cluster: ClusterSpec | None

    def relayout(self, plan: Plan, action: str, why: str) -> None: ...


def apply_move(cp: Movable, traces: Sequence[StepTrace], p: Proposal) -> dict[str, Any]:
    """Move ``cp``'s deployment as ``p`` proposed (module docstring); the target and how long
    the move took. :class:`BadRequest` when it cannot be applied, with the reason."""
    if cp.cluster is None:
        raise BadRequest("a move needs the plan's cluster spec (dmsc up --cluster)")
    found = replan(cp.plan, cp.cluster, tuple(traces))
    if isinstance(found, str):
        raise BadRequest(f"the move is no longer proposed: {found}")
    new = found.new_plan
    if [st.chunks for st in new.stages] != [st.chunks for st in cp.plan.stages]:
        raise BadRequest(
            f"{p.target}: a re-cut moves layers between stages, and the per-stage "
            "checkpoint does not carry over: not applied (dmsc plan, then dmsc up)"
        )
    try:  # the re-plan keeps to the rules of the spec; a move is checked where it is applied
        check_move(cp.cluster, new, f"the move of {p.target}")
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    t1 = time.perf_counter()
    cp.relayout(new, "move", f"{p.target}: {p.reason}")
    return {"target": p.target, "move_s": time.perf_counter() - t1}
