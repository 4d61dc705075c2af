"""The orchestrator's side of the functional modules: collect their proposals, decide on each,
log every decision with its reason, and apply what it can.

The decision rule (:class:`DecisionRule`, :func:`decide`):

- a move (``move-stage``, ``reroute``, ``recut``; the control loop's ``resize-dp`` and
  ``move-node``) is applied only when its predicted gain per step exceeds ``threshold`` times
  the current step time and its one-off cost (checkpoint, transfer, restart) is paid back
  within the horizon: ``cost / gain <= horizon_steps``, the horizon cut to the steps the
  training task has left when that is known (a gain after the task ends pays nothing back).
  Of several such moves only the one with the largest gain is applied: each was proposed
  against the current placement, not against the others;
- an ``exception`` (an objective the run breaks) is always raised into the exception queue;
- a ``forecast``, a ``keep`` (a module saw nothing to do) or an ``error`` (a module failed on this
  snapshot; the others still ran) is noted.

Applying (:func:`apply`): exceptions go into the exception queue
(:func:`~dmsc.runtime.control.advisors.policy.raise_into_queue`); a move goes to the control
plane, which moves the running deployment (:mod:`dmsc.runtime.control.replanning`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dmsc.data.db import Database
from dmsc.runtime.control.advisors.base import (
    MOVE_KINDS,
    FunctionalModule,
    Measurements,
    Proposal,
)
from dmsc.runtime.control.advisors.policy import raise_into_queue

log = logging.getLogger(__name__)

Verdict = Literal["apply", "refuse", "raise", "note"]


class NoDeployment(RuntimeError):
    """A move to apply, and no running deployment to apply it to."""


@dataclass(frozen=True)
class DecisionRule:
    """When a move is worth it."""

    threshold: float = 0.05  # the gain must exceed this share of the current step time
    horizon_steps: int = 1000  # and the cost be paid back within this many steps

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.horizon_steps < 0:
            raise ValueError("threshold and horizon_steps must not be negative")


@dataclass(frozen=True)
class Decision:
    """The orchestrator's verdict on one proposal, and why."""

    proposal: Proposal
    verdict: Verdict
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "why": self.reason, **self.proposal.as_json()}


def collect(modules: Iterable[FunctionalModule], measurements: Measurements) -> list[Proposal]:
    """Every module's proposals on ``measurements``; a module that fails gives an ``error``
    proposal with its exception, and the others still run (the modules are independent)."""
    out: list[Proposal] = []
    for module in modules:
        try:
            out.extend(module.propose(measurements))
        except Exception as exc:  # one module's bug must not silence the others
            log.warning("module %s failed: %s: %s", module.name, type(exc).__name__, exc)
            log.debug("module %s failed", module.name, exc_info=True)
            out.append(Proposal(module.name, "error", "module", f"{type(exc).__name__}: {exc}"))
    return out


def _judge_move(p: Proposal, rule: DecisionRule, horizon: int, cut: str) -> Decision:
    gain, now = p.predicted_gain_s_per_step, p.current_s_per_step
    if gain <= 0:
        return Decision(p, "refuse", "no predicted gain")
    if now <= 0:
        return Decision(p, "refuse", "no current step time to weigh the gain against")
    share = gain / now
    if share <= rule.threshold:
        return Decision(
            p,
            "refuse",
            f"gain {gain * 1e3:.1f} ms/step is {share:.1%} of the {now:.3f} s step, not above "
            f"the {rule.threshold:.1%} threshold",
        )
    payback = p.payback_steps
    if payback > horizon:
        return Decision(
            p,
            "refuse",
            f"its cost of {p.cost_s:.1f} s is paid back in {payback:.0f} steps, beyond the "
            f"horizon of {horizon} steps{cut}",
        )
    return Decision(
        p,
        "apply",
        f"gain {gain * 1e3:.1f} ms/step ({share:.1%} of the step) pays back its cost of "
        f"{p.cost_s:.1f} s in {payback:.0f} steps, within the horizon of {horizon} steps{cut}",
    )


def decide(
    proposals: Sequence[Proposal], rule: DecisionRule, remaining_steps: int | None = None
) -> list[Decision]:
    """A decision on each proposal, in their order, each logged with its reason."""
    horizon, cut = rule.horizon_steps, ""
    if remaining_steps is not None and remaining_steps < horizon:
        horizon, cut = remaining_steps, " (the steps the task has left)"
    out: list[Decision] = []
    for p in proposals:
        if p.kind in MOVE_KINDS:
            out.append(_judge_move(p, rule, horizon, cut))
        elif p.kind == "exception":
            out.append(Decision(p, "raise", "an objective is broken: to the exception queue"))
        elif p.kind == "error":
            out.append(Decision(p, "note", "the module failed on this snapshot"))
        else:
            out.append(Decision(p, "note", "for information"))
    applied = [d for d in out if d.verdict == "apply"]
    if len(applied) > 1:  # alternatives, each against the current placement: the best one
        best = max(applied, key=lambda d: d.proposal.predicted_gain_s_per_step)
        out = [
            Decision(d.proposal, "refuse", f"a larger gain is applied ({best.proposal.target})")
            if d.verdict == "apply" and d is not best
            else d
            for d in out
        ]
    for d in out:
        p = d.proposal
        log.info(
            "%s %s %s (%s): %s",
            d.verdict,
            p.module,
            p.kind,
            p.target,
            d.reason,
            extra={"functional_module": p.module, "verdict": d.verdict},
        )
    return out


def orchestrate(
    modules: Iterable[FunctionalModule], measurements: Measurements, rule: DecisionRule
) -> list[Decision]:
    """Collect the modules' proposals on ``measurements`` and decide on each."""
    return decide(collect(modules, measurements), rule, measurements.remaining_steps)


def apply(
    db: Database,
    run_id: int,
    decisions: Sequence[Decision],
    now_s: float,
    move: Callable[[Proposal], None] | None = None,
) -> list[int]:
    """Act on the decisions: the move to apply through ``move`` (the control plane's: it
    moves the deployment; without one :class:`NoDeployment` is raised before anything is
    done), and each raised exception into the exception queue (the ids of the tasks it made; a
    breach raised recently is not raised again)."""
    moves = [d for d in decisions if d.verdict == "apply"]
    if moves and move is None:
        raise NoDeployment(
            f"applying a move ({moves[0].proposal.target}) needs the running deployment: "
            "`dmsc replan` with a control plane up"
        )
    for d in moves:  # decide() applies one at most
        assert move is not None
        move(d.proposal)
        log.warning("move applied: %s", d.proposal.target)
    raised = []
    for d in decisions:
        if d.verdict == "raise":
            task = raise_into_queue(db, run_id, d.proposal, now_s)
            if task is not None:
                log.warning("exception raised: %s", d.proposal.reason, extra={"task_id": task})
                raised.append(task)
    return raised
