"""The loop's proposals to grow or shrink training's data-parallel degree (``resize-dp``).

Pure functions over what a snapshot holds of the devices (:class:`DeviceView`) and the
measured step; the runner applies an accepted resize through
:mod:`dmsc.runtime.control.training.resize` (between tasks at once, during a task at its next
step boundary: checkpoint, re-plan, resume). Three causes:

- **devices go**: a datacenter offers fewer devices than the deployment's replicas hold there
  (a Ray node lost and no spare took its workers: the launcher's ``dc:NAME`` resources of the
  nodes alive). The replicas holding devices there are dropped, the highest ranks first, the
  fewest that make every datacenter fit. Without it the task cannot step, so the proposal is
  *forced*: its gain is the whole step, it skips the hysteresis, and the decision rule's
  refusal for the horizon is overruled (:func:`force`). During a task the session's own
  recovery shrinks first, when it finds no room for a lost replica
  (:mod:`dmsc.runtime.control.training.shrink`); the loop's resize then finds dp there already;
- **devices come back**: dp is below the plan's (the dp the run started with) or the policy's
  ``dp_min``, and the devices online hold more replicas: grow back, as far as they fit;
- **the policy asks** (``elastic`` in the policy file): while the step-time objective is broken
  and devices are free, grow by one replica, never past ``dp_max`` (nor below ``dp_min``).

A grow's predicted gain is the measured median step scaled by ``dp / new dp``: the ideal
scaling of the per-replica work of a fixed global batch, which leaves out the all-reduce among
more replicas (an optimistic figure; the effect measured after the resize, in the decision's
row, says by how much). Its cost is the policy's ``cost_s`` (a checkpoint, the workers' restart
and the load). Everything else goes through the decision rule and the hysteresis as a move
does: confirmed over ticks, and dp resized within the cool-down is not resized again.

The re-plan places on the devices online the proposal saw (its ``online`` detail: the cluster
spec cut down to them, :func:`~dmsc.runtime.control.training.online.plan_online`, as the
shrink does), so that no replica lands on a lost device; a plan that still puts more devices
in a datacenter than are online there (nodes lost since) is not applied, with the reason
(:func:`~dmsc.runtime.control.training.resize.check_online`).

A resize the deployment cannot make now (task heads, elastic serving replicas, no cluster
spec, a running task whose replicas differ between steps) is a ``keep`` note with the reason.
So is one while a failed shrink left no deployment (the control plane's ``undeployed``): the
loop skips it rather than redeploy, since the next training task redeploys first anyway, at
the largest dp the devices online then hold (``Shrink.redeploy``,
:mod:`dmsc.runtime.control.training.shrink`), from the newest checkpoint that verifies, and a
resize has no running deployment to checkpoint; one accepted before the shrink failed is
skipped where it is applied (:mod:`.moves`), with the same words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.base import Proposal
from dmsc.runtime.control.advisors.orchestrator import Decision
from dmsc.runtime.control.loop.objectives import Policy

MODULE = "elastic-dp"
# why a resize or a move is skipped while a failed shrink left no deployment (module docstring)
NO_DEPLOYMENT = "skipped: no deployment, the next training task redeploys first"
DEFAULT_COST_S = 10.0  # a resize's cost without a policy's elastic.cost_s (objectives.Elastic)


@dataclass(frozen=True)
class DeviceView:
    """The deployment's replicas against the devices online, by datacenter."""

    dp: int  # replicas now
    base_dp: int  # the dp of the plan the run started with: what devices coming back restore
    held: tuple[Mapping[str, int], ...]  # by replica rank: devices it holds, by datacenter
    capacity: Mapping[str, int]  # devices online by datacenter
    source: str  # where the capacity was read ("the cluster spec", "the Ray cluster")
    blocked: str | None = None  # why no resize can be made now, if none can

    def used(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rep in self.held:
            for dc, n in rep.items():
                out[dc] = out.get(dc, 0) + n
        return out

    def short(self) -> dict[str, int]:
        """Datacenters offering fewer devices than the replicas hold there: the shortfall."""
        used = self.used()
        return {
            dc: n - self.capacity.get(dc, 0)
            for dc, n in used.items()
            if n > self.capacity.get(dc, 0)
        }

    def shrunk(self) -> int:
        """The dp left once the fewest replicas (highest ranks first) holding devices in a
        short datacenter are dropped (0: none fits)."""
        short = self.short()
        keep = list(range(self.dp))
        for r in reversed(range(self.dp)):
            if not short:
                break
            if any(self.held[r].get(dc, 0) for dc in short):
                keep.remove(r)
                for dc in list(short):
                    short[dc] -= self.held[r].get(dc, 0)
                    if short[dc] <= 0:
                        del short[dc]
        return len(keep) if not short else 0

    def fits(self, dp: int) -> bool:
        """Whether ``dp`` replicas shaped as replica 0 fit the devices online in all (the
        re-plan places them; it refuses, with the reason, what does not fit after all)."""
        per = sum(self.held[0].values()) if self.held else 0
        return per * dp <= sum(self.capacity.values())


def device_view(
    plan: Plan, base_dp: int, capacity: Mapping[str, int], source: str, blocked: str | None
) -> DeviceView:
    """The view of ``plan``'s replicas (rank by rank) against ``capacity``."""
    held: list[dict[str, int]] = [{} for _ in range(plan.job.dp)]
    for st in plan.stages:
        for r, rep in enumerate(st.replicas):
            held[r][rep.datacenter] = held[r].get(rep.datacenter, 0) + len(rep.devices)
    return DeviceView(plan.job.dp, base_dp, tuple(held), dict(capacity), source, blocked)


def _resize(
    view: DeviceView, new: int, step_s: float | None, cost_s: float, why: str, forced: bool
) -> Proposal:
    now = step_s or 0.0
    # forced: the task cannot step at all, the whole step is gained
    gain = now if forced else now * (1 - view.dp / new)
    return Proposal(
        MODULE,
        "resize-dp",
        f"dp {view.dp}->{new}",
        why,
        predicted_gain_s_per_step=gain,
        current_s_per_step=now,
        cost_s=cost_s,
        details={
            "dp": {"current": view.dp, "proposed": new},
            "forced": forced,
            "online": dict(view.capacity),  # the re-plan is checked against it when applied
        },
    )


def propose(
    view: DeviceView | None,
    policy: Policy,
    step_s: float | None,
    step_breach: str | None,
) -> list[Proposal]:
    """The resize the devices or the policy ask for (module docstring), at most one; a
    ``keep`` note when one is asked for and cannot be made. ``step_breach``: why the
    step-time objective is broken now (None: it holds, or is not set)."""
    if view is None:
        return []
    el = policy.elastic
    cost = el.cost_s if el is not None else DEFAULT_COST_S
    found: Proposal | None = None
    short = view.short()
    if short:
        new = view.shrunk()
        lost = ", ".join(f"{dc} short of {n}" for dc, n in sorted(short.items()))
        why = f"devices lost ({lost}, as {view.source} says): the replicas cannot all run"
        if new < 1:
            return [Proposal(MODULE, "keep", "dp", f"{why}; not even one replica fits")]
        found = _resize(view, new, step_s, cost, f"{why}; shrink to {new}", forced=True)
    else:
        grow = view.dp
        reasons = []
        floor = max(view.base_dp, el.dp_min if el is not None else 1)
        if view.dp < floor:
            back = max((d for d in range(view.dp + 1, floor + 1) if view.fits(d)), default=0)
            if back:
                grow = back
                reasons.append(
                    f"devices are back ({view.source}): grow toward dp {floor} (the plan's, "
                    "or the policy's dp_min)"
                )
        top = el.dp_max if el is not None else 0
        if step_breach is not None and view.dp < top and view.fits(view.dp + 1):
            if view.dp + 1 > grow:
                grow = view.dp + 1
            reasons.append(f"{step_breach}: the policy grows dp within {el.dp_min}..{top}")  # type: ignore[union-attr]
        if grow > view.dp:
            why = "; ".join(reasons)
            found = _resize(view, grow, step_s, cost, why, forced=False)
    if found is not None and view.blocked is not None:
        return [Proposal(MODULE, "keep", "dp", f"{found.reason}; not now: {view.blocked}")]
    return [found] if found is not None else []


def force(decisions: Sequence[Decision]) -> list[Decision]:
    """A forced resize (devices lost) applies even where the rule refused it (for its payback,
    or for a larger gain elsewhere); no other move applies at that tick."""
    if not any(d.proposal.details.get("forced") for d in decisions):
        return list(decisions)
    out = []
    for d in decisions:
        if d.proposal.details.get("forced") and d.verdict != "apply":
            why = f"{d.reason}; applied anyway: the task cannot step as it is"
            d = Decision(d.proposal, "apply", why)
        elif d.verdict == "apply" and not d.proposal.details.get("forced"):
            d = Decision(d.proposal, "refuse", "a forced resize goes first (devices lost)")
        out.append(d)
    return out
