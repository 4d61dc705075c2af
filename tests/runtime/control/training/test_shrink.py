"""The decision of a task that lost replicas for good (:func:`dmsc.runtime.control.training.
shrink.decide`): which dp is left and when the shrink is refused; the shrink over a control
plane stand-in: the next smaller dp when a layout does not start, and no deployment left (said,
then redeployed) when none does. The shrink on real workers (re-plan, restart from the newest
checkpoint that verifies, equal losses) is tests/integration/test_ray_shrink.py's."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from modules_helpers import make_plan, two_sites

from dmsc.planner.plan import Plan
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.launch.fallback import Restored
from dmsc.runtime.control.launch.launchers import WorkerStartError
from dmsc.runtime.control.launch.layout import Checkpoint
from dmsc.runtime.control.training import shrink
from dmsc.runtime.control.training.online import ResizedPlans
from dmsc.runtime.control.training.restart import NoDeployment
from dmsc.runtime.control.training.shrink import Shrink, decide
from dmsc.spec import JobSpec, resolve_model

MODEL = resolve_model("gpt-mini")

# dp 2 x pp 2: each replica holds one device at site-a (stage 0) and one at site-b (stage 1)
PLAN = make_plan(two_sites())
LOST_A = {"site-a": 1, "site-b": 2}  # a site-a node lost: one replica's stage 0 has no room


def test_the_lost_replicas_are_dropped_when_a_datacenter_is_short() -> None:
    assert PLAN.job.dp == 2
    assert decide(PLAN, [(0, 0)], 1, LOST_A) == (1, None)  # replica 0 lost: dp 1 goes on
    assert decide(PLAN, {(0, 1): "lost"}, 1, LOST_A) == (1, None)
    assert decide(PLAN, [(0, 1), (1, 1)], 1, LOST_A) == (1, None)  # one replica, two stages


def test_a_shrink_below_the_floor_is_refused() -> None:
    new, why = decide(PLAN, [(0, 0)], 2, LOST_A)  # the policy's elastic dp_min is 2
    assert new == 1 and why is not None and "below 2" in why and "dp_min" in why
    new, why = decide(PLAN, [(0, 0), (1, 1)], 1, {"site-a": 0, "site-b": 0})
    assert new == 0 and why is not None and "leaves dp 0, below 1" in why


def test_dp_1_never_shrinks_by_default() -> None:
    plan = make_plan(two_sites(), JobSpec(global_batch=8, micro_batch=2, pp=2, dp=1))
    new, why = decide(plan, [(0, 0)], 1, {"site-a": 0, "site-b": 2})
    assert new == 0 and why is not None and "below 1" in why


def test_no_shrink_without_a_lost_node_or_with_replicas_that_differ() -> None:
    full = {"site-a": 2, "site-b": 2}
    _, why = decide(PLAN, [(0, 0)], 1, full)
    assert why is not None and "still hold every replica" in why  # a start failure, not room
    _, why = decide(PLAN, [(0, 0)], 1, None)
    assert why is not None and "cannot say which devices are online" in why  # local launcher
    _, why = decide(PLAN, [(0, 0)], 1, LOST_A, together=True)
    assert why is not None and "differ between steps" in why
    _, why = decide(PLAN, [], 1, LOST_A)
    assert why == "the failure names no worker"


# -- the shrink itself over a control plane stand-in: the re-plan on the devices online, the
# next smaller dp when a layout does not start, and no deployment left when none does


class Started:
    """A deployment stand-in: its plan's layout, and the launcher's view of the devices."""

    def __init__(self, plan: Any, capacity: dict[str, int]) -> None:
        self.plan, self.epoch = plan, 0
        self.layout = SimpleNamespace(replicas=plan.job.dp)
        self.launcher = SimpleNamespace(capacity=lambda: capacity)

    def sid(self, stage: int, replica: int, rank: int = 0) -> str:
        return f"s{stage}r{replica}"


class Plane:
    """What a shrink reads and changes of the control plane, recorded."""

    def __init__(self, plan: Any, capacity: dict[str, int]) -> None:
        self.plan, self.deployment = plan, Started(plan, capacity)
        self.events: list[Any] = []
        self.db = SimpleNamespace(add=self.events.append)
        self.model, self.device, self.cluster = MODEL, "cpu", two_sites()
        self.steps_done, self.undeployed, self.weights_lost = 0, None, None
        self.run = SimpleNamespace(id=1)
        self.inference = SimpleNamespace(pool=None, heads=False, rebind=self._rebind)
        self.served: list[Any] = []
        self.saved = [Checkpoint(6, {}), Checkpoint(4, {})]  # the run's, newest first
        self.plans = ResizedPlans()  # the control plane's re-plans (.training.online)

    def _rebind(self, dep: Any) -> None:
        self.served.append(dep)

    def record_services(self) -> None:
        pass

    def record_refused(self, restored: Restored, task_id: int | None = None) -> None:
        pass

    def checkpoints(self, task_id: int | None = None) -> list[Checkpoint]:
        return self.saved

    def resized(self, dp: int, online: Mapping[str, int] | None = None) -> Plan:
        return self.plans.get(self.plan, MODEL, self.cluster, dp, online)


def _launcher(monkeypatch: pytest.MonkeyPatch, fails: set[int]) -> list[Any]:
    """Layouts of a dp in ``fails`` do not start (no room); the others start, with the newest
    candidate checkpoint loaded. What happened, in order: ("stop", dp) and ("start", dp)."""
    seen: list[Any] = []

    def restarter(dep: Any) -> str:
        seen.append(("stop", dep.layout.replicas))
        return "start"

    def restart_from(
        start: str, old: Any, plan: Any, model: Any, device: str, candidates: Any, spec: Any
    ) -> tuple[Any, Restored]:
        seen.append(("start", plan.job.dp))
        if plan.job.dp in fails:
            raise WorkerStartError(f"no node of dc-0 has room for a dp-{plan.job.dp} worker")
        return Started(plan, {}), Restored(candidates[0])

    monkeypatch.setattr(shrink, "restarter", restarter)
    monkeypatch.setattr(shrink, "restart_from", restart_from)
    return seen


def _one_dc_plan(dp: int) -> Any:
    """A plan of ``dp`` one-device replicas in datacenter ``a`` (what the shrink reads)."""
    reps = [SimpleNamespace(datacenter="a", devices=[i]) for i in range(dp)]
    stage = SimpleNamespace(index=0, replicas=reps)
    return SimpleNamespace(job=SimpleNamespace(dp=dp), stages=[stage])


def test_a_layout_that_does_not_start_is_followed_by_the_next_smaller_dp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp = Plane(_one_dc_plan(4), {"a": 3})  # replica 0's node lost: 3 devices left
    planned: list[tuple[int, Any]] = []

    def resized(dp: int, online: Any = None) -> Any:
        planned.append((dp, online))
        return _one_dc_plan(dp)

    cp.resized = resized  # type: ignore[method-assign]
    seen = _launcher(monkeypatch, fails={3})
    old, failure = cp.deployment, WorkerFailure({(0, 0): "lost with its Ray node"}, {})
    dep, rec = Shrink(cp)(old, failure, WorkerStartError("no room"), cp.saved)
    assert planned == [(3, {"a": 3}), (2, {"a": 3})]  # each on the devices online
    assert seen == [("stop", 4), ("start", 3), ("start", 2)]  # the old one stopped once
    assert cp.deployment is dep and cp.plan.job.dp == dep.layout.replicas == 2
    assert cp.served == [dep] and rec.checkpoint_step == 6 and cp.undeployed is None
    (event,) = cp.events
    assert (event.action, event.replicas_after) == ("lost-dp", 2)
    assert "dp 4 -> 2" in event.reason and "dp 3 did not start: WorkerStartError" in event.reason


def test_no_layout_that_starts_leaves_no_deployment_and_the_next_task_redeploys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dp 2 -> 1 after a site-a device is lost, re-planned on the devices online; the dp-1
    layout does not start either. The task fails naming the cause, every dp tried and the
    checkpoint kept; the plane says it has no deployment; the next task's redeploy starts the
    largest dp the devices online hold, from the run's newest checkpoint."""
    cp = Plane(PLAN, {"site-a": 1, "site-b": 2})
    seen = _launcher(monkeypatch, fails={1})
    old, failure = cp.deployment, WorkerFailure({(0, 0): "lost with its Ray node"}, {})
    hook = Shrink(cp)
    with pytest.raises(NoDeployment) as caught:
        hook(old, failure, WorkerStartError("no room for replica 0"), cp.saved[1:])
    said = str(caught.value)
    assert "after losing replica(s) [0] (stage 0 replica 0 (?): lost with its Ray node)" in said
    assert "started nothing: the checkpoint of step 4 is kept" in said, said
    assert "dp 1 did not start: WorkerStartError: no node of dc-0 has room" in said, said
    assert seen == [("stop", 2), ("start", 1)] and cp.deployment is old and not cp.events
    assert cp.undeployed is not None and "replica(s) [0] were lost" in cp.undeployed
    assert "the checkpoint of step 4 is kept" in cp.undeployed
    with pytest.raises(NoDeployment, match="training refused: no workers since") as caught:
        hook.redeploy()  # the devices online hold dp 1 only, and it still does not start
    assert "dp 2 not planned" in str(caught.value) and "dp 1 did not start" in str(caught.value)
    assert seen[2:] == [("start", 1)] and cp.undeployed is not None
    seen.clear()
    cp.deployment.launcher = SimpleNamespace(capacity=lambda: {"site-a": 2, "site-b": 2})
    _launcher(monkeypatch, fails=set())
    hook.redeploy()  # the node is back
    assert cp.undeployed is None and cp.plan.job.dp == 2 and cp.deployment is not old
    assert cp.steps_done == 6  # the run's newest checkpoint
    (event,) = cp.events
    assert event.action == "redeploy" and "from the checkpoint of step 6" in event.reason
