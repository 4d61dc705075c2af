"""``dmsc replan`` against the running control plane: decide now, and apply what was decided.

Between two training tasks (holding the plane's lock, as tasks do), the functional modules read
the run's measurements (:func:`~.modules.read_measurements`; the plan is the deployment's
current one, which a resize or an earlier move may have changed) and the orchestrator decides
(:func:`~.modules.orchestrate`). Unless the request is a dry run:

- exceptions go into the exception queue;
- an applied move re-plans on the measured figures again (the same re-plan the proposal came
  from) and moves the deployment to that plan from a checkpoint (``ControlPlane.relayout``:
  the workers stop and start where the plan puts them; weights and AdamW state carry over).
  Only a move that keeps each stage's layers is applied: a re-cut changes which stage holds
  which layers, and the per-stage checkpoint does not carry over (refused, with the reason).

The answer lists every decision with its reason, what was applied, and how long deciding and
moving took.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dmsc.runtime.control.modules import default_modules, orchestrate, read_measurements
from dmsc.runtime.control.modules.base import Proposal
from dmsc.runtime.control.modules.orchestrator import DecisionRule, apply
from dmsc.runtime.control.modules.paths import replan
from dmsc.runtime.transport.messages import ReplanRequest
from dmsc.runtime.transport.rpc import BadRequest


def replan_now(cp: Any, req: ReplanRequest) -> dict[str, Any]:
    """Decide on the run's measurements now and, unless ``req.dry_run``, apply (module
    docstring). ``cp`` is the :class:`~.plane.ControlPlane`."""
    with cp.lock:  # between tasks: a training task holds it
        t0 = time.perf_counter()
        measured = read_measurements(cp.db, cp.run.id, time.time())
        measured = dataclasses.replace(measured, plan=cp.plan)
        rule = DecisionRule(req.threshold, req.horizon_steps)
        decisions = orchestrate(default_modules(cp.cluster), measured, rule)
        decide_s = time.perf_counter() - t0
        applied: dict[str, Any] | None = None

        def move(p: Proposal) -> None:
            nonlocal applied
            if cp.cluster is None:
                raise BadRequest("a move needs the plan's cluster spec (dmsc up --cluster)")
            found = replan(cp.plan, cp.cluster, measured.traces)
            if isinstance(found, str):
                raise BadRequest(f"the move is no longer proposed: {found}")
            new = found.new_plan
            if [st.chunks for st in new.stages] != [st.chunks for st in cp.plan.stages]:
                raise BadRequest(
                    f"{p.target}: a re-cut moves layers between stages, and the per-stage "
                    "checkpoint does not carry over: not applied (dmsc plan, then dmsc up)"
                )
            t1 = time.perf_counter()
            cp.relayout(new, "move", f"{p.target}: {p.reason}")
            applied = {"target": p.target, "move_s": time.perf_counter() - t1}

        raised: list[int] = []
        if not req.dry_run:
            raised = apply(cp.db, cp.run.id, decisions, time.time(), move=move)
    return {
        "run": cp.run.id,
        "dry_run": req.dry_run,
        "decide_s": decide_s,
        "decisions": [
            {**d.proposal.as_json(), "decision": d.verdict, "why": d.reason} for d in decisions
        ],
        "applied": applied,
        "exceptions_raised": raised,
        "datacenters": [st.datacenter for st in cp.plan.stages],
    }
