"""Applying a move the orchestrator accepted: the deployment goes to the re-planned placement.

Shared by ``dmsc replan`` (:mod:`..replanning`) and the control loop (:mod:`.runner`); the
caller holds the control plane's task lock (between training tasks). The move re-plans on the
measured figures again (the same re-plan the proposal came from) and moves the deployment to
that plan from a checkpoint (``relayout``: the workers stop and start where the plan puts them;
weights and AdamW state carry over). The workers' restart would cut the inference requests they
are answering ("Channel closed"), so the move first shuts the replicas' gates and waits, at most
``drain_s``, for the requests in flight to end; new ones wait at the gates (or go to the elastic
serving replicas) until the move is done. Requests still running then: :class:`StillServing`,
and nothing moved (the control loop tries again at its next tick). Only a move that keeps each
stage's layers is applied: a re-cut changes which stage holds which layers, and the per-stage
checkpoint does not carry over (refused, with the reason), and so is one that would put a stage
where a residency rule of the cluster spec keeps the model's weights out (naming the rule). A
``move-node`` (a stage replica from a busy node to an idle one of its datacenter, :mod:`.busy`)
is not re-planned: the replica goes to free devices of that node
(:func:`dmsc.planner.elastic.move_replica`), refused when it left its node since or the node
has no room now.

A resize of training's data-parallel degree (``resize-dp``, :mod:`.resizing`) goes through
:mod:`..training.resize`: between tasks :func:`resize_now` relays the deployment out under the
task lock, after the same wait for the requests in flight; during a task :func:`hand_over`
asks the running session, which makes it before its next step and writes the outcome. Both
re-plan on the devices online the proposal saw (:mod:`..training.online`). While a failed
shrink left no deployment, a move or a resize is skipped with the reason (:mod:`.resizing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from dmsc.data.traces import StepTrace
from dmsc.planner.elastic import move_replica
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.base import Proposal
from dmsc.runtime.control.advisors.paths import replan
from dmsc.runtime.control.loop.busy import numbered_on
from dmsc.runtime.control.loop.resizing import NO_DEPLOYMENT
from dmsc.runtime.control.training.residency import check_move
from dmsc.runtime.control.training.resize import Asked, check_online
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec

# the longest a move waits for the inference requests in flight (new ones wait as long)
DRAIN_S = 15.0


class StillServing(BadRequest):
    """Inference requests were still in flight when the move's wait for them ran out."""


class Gates(Protocol):
    """The replicas' gates (:meth:`~..serving.inference.Replicas.paused`)."""

    def paused(self, why: str, timeout_s: float) -> AbstractContextManager[int]: ...


class Movable(Protocol):
    """What a move reads of the control plane, and the one thing it asks of it."""

    plan: Plan
    cluster: ClusterSpec | None

    @property
    def inference(self) -> Gates: ...

    def relayout(self, plan: Plan, action: str, why: str) -> None: ...


class Resizable(Movable, Protocol):
    """A control plane that also re-plans at another dp (:mod:`..training.resize`)."""

    def resized(self, dp: int, online: Mapping[str, int] | None = None) -> Plan: ...


def apply_move(
    cp: Movable, traces: Sequence[StepTrace], p: Proposal, drain_s: float = DRAIN_S
) -> dict[str, Any]:
    """Move ``cp``'s deployment as ``p`` proposed (module docstring); the target and how long
    the move took (``drain_s``: the wait for the requests in flight). :class:`BadRequest` when
    it cannot be applied, with the reason (:class:`StillServing`: not now)."""
    _deployed(cp)
    if cp.cluster is None:
        raise BadRequest("a move needs the plan's cluster spec (dmsc up --cluster)")
    spec = numbered_on(cp) or cp.cluster  # the spec the plan's nodes are numbered on (.busy)
    if p.kind == "move-node":
        new = _to_node(cp.plan, spec, p)
    else:
        found = replan(cp.plan, cp.cluster, tuple(traces), busy=p.details.get("busy") or ())
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
    drained = _drained(cp, new, "move", p, drain_s)
    if p.kind == "move-node" and spec is not cp.cluster:  # still on the spec cut down
        getattr(cp, "resized_plans").note(new, spec)  # noqa: B009 (there: .busy.numbered_on)
    return {"target": p.target, "move_s": time.perf_counter() - t1, "drain_s": drained}


def _to_node(plan: Plan, cluster: ClusterSpec, p: Proposal) -> Plan:
    """``plan`` with the stage replica of a ``move-node`` on its idle node (:mod:`.busy`);
    :class:`BadRequest` when the replica left its node since, or the node has no room now."""
    n = p.details["node"]
    stage, replica = int(n["stage"]), int(n["replica"])
    try:
        rep = plan.stages[stage].replicas[replica]
    except IndexError:
        raise BadRequest(f"{p.target}: the plan has no stage {stage} replica {replica}") from None
    now = sorted(set(rep.nodes))
    if now != [int(n["from"])]:
        raise BadRequest(f"the move is no longer proposed: {p.target}, the replica is on {now}")
    try:
        return move_replica(plan, cluster, stage, replica, int(n["to"]))
    except ValueError as exc:
        raise BadRequest(f"the move is no longer proposed: {p.target}: {exc}") from None


def _deployed(cp: Any) -> None:
    """:class:`BadRequest` while a failed shrink left no deployment (``undeployed``): nothing
    to checkpoint or move (:mod:`.resizing`: skipped, not redeployed)."""
    if undeployed := getattr(cp, "undeployed", None):
        raise BadRequest(f"{NO_DEPLOYMENT} ({undeployed})")


def _dp(p: Proposal) -> int:
    return int(p.details["dp"]["proposed"])


def resize_now(cp: Resizable, p: Proposal, drain_s: float = DRAIN_S) -> dict[str, Any]:
    """Resize ``cp``'s deployment between tasks as ``p`` proposed (the caller holds the task
    lock); how long it took. :class:`BadRequest` with the reason when it cannot be made."""
    _deployed(cp)
    try:
        online = p.details.get("online")
        plan = cp.resized(_dp(p), online)  # on the devices online (..training.online)
        check_online(plan, online)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    t1 = time.perf_counter()
    _drained(cp, plan, "loop-dp", p, drain_s)
    return {"target": p.target, "move_s": time.perf_counter() - t1}


def _drained(cp: Any, plan: Any, action: str, p: Proposal, drain_s: float) -> float:
    """Shut the replicas' gates, wait for the inference in flight, then lay ``cp`` out on
    ``plan`` (``action``: ``move`` or ``loop-dp``); the seconds the drain took.
    :class:`StillServing` when requests are still in flight after ``drain_s``."""
    what, done = ("a move", "moved") if action == "move" else ("a resize", "resized")
    t1 = time.perf_counter()
    with cp.inference.paused(f"{what} ({p.target})", drain_s) as left:
        if left:
            n = f"{left} inference request{'s' if left > 1 else ''}"
            raise StillServing(f"{n} still in flight after {drain_s:g} s: not {done} now")
        drained = time.perf_counter() - t1
        cp.relayout(plan, action, f"{p.target}: {p.reason}")
    return drained


def hand_over(cp: Any, p: Proposal, done: Callable[[str], None]) -> int | None:
    """Ask the running training task to make resize ``p`` before its next step (``done`` is
    told the outcome); the task's id, or None when no task runs (:class:`..resize.Between`)."""
    between = getattr(cp, "between", None)
    if between is None:
        return None
    asked = Asked(_dp(p), f"{p.target}: {p.reason}", done, p.details.get("online"))
    task: int | None = between.ask(asked)
    return task
