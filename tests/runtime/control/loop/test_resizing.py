"""The loop's resize proposals (:mod:`dmsc.runtime.control.loop.resizing`) over hand-built device
views: a datacenter that lost its node shrinks dp (forced: through the rule's refusal and the
hysteresis, at every tick), devices back grow it to the plan's dp, the policy's ``elastic``
range grows it on a broken step-time objective and never past ``dp_max``, a blocked resize is
a note with its reason; and the policy's setting checked at the boundary."""

from __future__ import annotations

from dataclasses import replace

import pytest
from modules_helpers import make_plan, two_sites

from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors import Measurements, MetricPoint, TaskTimes
from dmsc.runtime.control.advisors.orchestrator import DecisionRule, decide
from dmsc.runtime.control.loop.objectives import Policy
from dmsc.runtime.control.loop.resizing import DeviceView, device_view, force, propose
from dmsc.runtime.control.loop.tick import LoopConfig, LoopState, Snapshot, tick
from dmsc.spec import SpecError
from dmsc.spec.loader import validate_document

NOW = 1_800_000_000.0
BOTH = {"site-a": 2, "site-b": 2}  # two-sites-cpu: two devices at each site
HALF = {"site-a": 2, "site-b": 1}  # one of site-b's devices gone (a Ray node of one)


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(two_sites())  # dp 2 of two stages: stage 0 at site-a, stage 1 at site-b


def _view(plan: Plan, capacity: dict[str, int], base_dp: int = 2) -> DeviceView:
    return device_view(plan, base_dp, capacity, "the Ray cluster's nodes", None)


def _policy(**extra: object) -> Policy:
    return Policy.model_validate({"slos": {"step_time_s": 0.5}, "confirm_ticks": 3, **extra})


def test_the_view_holds_each_replica_at_its_site(plan: Plan) -> None:
    view = _view(plan, BOTH)
    assert view.dp == 2 and sorted(sum(r.values()) for r in view.held) == [2, 2]
    assert view.held == ({"site-a": 1, "site-b": 1}, {"site-a": 1, "site-b": 1})
    assert view.short() == {} and view.fits(2) and not view.fits(3)


def test_a_lost_node_shrinks_dp_by_the_replica_it_held(plan: Plan) -> None:
    view = _view(plan, HALF)
    assert view.short() == {"site-b": 1} and view.shrunk() == 1
    [p] = propose(view, _policy(), 2.0, None)
    assert (p.kind, p.target, p.details["forced"]) == ("resize-dp", "dp 2->1", True)
    assert "site-b short of 1" in p.reason and "Ray cluster" in p.reason
    # the rule refuses it for a horizon of 3 steps (10 s / 2 s = 5 steps); forced, it applies
    [d] = force(decide([p], DecisionRule(0.05, 1000), remaining_steps=3))
    assert d.verdict == "apply" and "cannot step" in d.reason
    assert _view(plan, {"site-a": 0, "site-b": 0}).shrunk() == 0
    [note] = propose(_view(plan, {"site-a": 2, "site-b": 0}), _policy(), 2.0, None)
    assert note.kind == "keep" and "not even one replica" in note.reason


def test_a_forced_shrink_applies_at_every_tick_past_the_hysteresis(plan: Plan) -> None:
    metrics = tuple(MetricPoint(i, 3.0, 0.2, 10.0) for i in range(5))
    task = TaskTimes(1, "train", "running", "default", "sync", NOW - 60, NOW - 50, None)
    snap = Snapshot(Measurements(1, plan, NOW, 1, metrics, (), (task,)))
    lost = replace(snap, devices=_view(plan, HALF))
    config = LoopConfig(_policy())
    res = tick(lost, config, LoopState(), [])
    [d] = [d for d in res.decisions if d.proposal.kind == "resize-dp"]
    assert d.verdict == "apply" and len(res.recorded) == 1
    # the next tick, no new step (the modules are not due): still proposed, not recorded again
    again = tick(lost, config, res.state, [])
    assert [d.verdict for d in again.decisions if d.proposal.kind == "resize-dp"] == ["apply"]
    assert not again.recorded


def test_devices_back_grow_dp_to_the_plans(plan: Plan) -> None:
    stages = [st.model_copy(update={"replicas": st.replicas[:1]}) for st in plan.stages]
    one = plan.model_copy(update={"job": plan.job.model_copy(update={"dp": 1}), "stages": stages})
    [p] = propose(_view(one, BOTH), _policy(), 2.0, None)
    assert (p.target, p.details["forced"]) == ("dp 1->2", False)
    assert p.predicted_gain_s_per_step == pytest.approx(1.0)  # 2 s scaled by 1/2
    assert "devices are back" in p.reason
    assert propose(_view(one, HALF), _policy(), 2.0, None) == []  # room for one only
    [d] = decide([p], DecisionRule(0.05, 1000))
    assert d.verdict == "apply"


def test_the_policy_grows_dp_within_its_range_on_a_slow_step(plan: Plan) -> None:
    view = _view(plan, {"site-a": 4, "site-b": 2})  # room for a third replica
    slow = "median step 2.000 s over the last 5 steps of task 1"
    assert propose(view, _policy(), 2.0, slow) == []  # no elastic range: no policy resize
    [p] = propose(view, _policy(elastic={"dp_max": 3, "cost_s": 4}), 2.0, slow)
    assert p.target == "dp 2->3" and p.cost_s == 4
    assert slow in p.reason and "grows dp within 1..3" in p.reason
    assert p.predicted_gain_s_per_step == pytest.approx(2.0 / 3)
    assert propose(view, _policy(elastic={"dp_max": 2}), 2.0, slow) == []  # at dp_max
    assert propose(view, _policy(elastic={"dp_max": 3}), 2.0, None) == []  # the step is fine
    assert propose(_view(plan, BOTH), _policy(elastic={"dp_max": 3}), 2.0, slow) == []  # full
    # below the policy's dp_min, devices allowing: back up to it, the step fine or not
    [up] = propose(view, _policy(elastic={"dp_min": 3, "dp_max": 4}), 2.0, None)
    assert up.target == "dp 2->3" and "dp_min" in up.reason


def test_a_resize_the_deployment_cannot_make_is_a_note(plan: Plan) -> None:
    view = replace(_view(plan, HALF), blocked="the replicas hold task heads")
    [p] = propose(view, _policy(), 2.0, None)
    assert p.kind == "keep" and "not now: the replicas hold task heads" in p.reason
    assert propose(None, _policy(), 2.0, None) == []  # no cluster spec: no view


def test_the_elastic_setting_is_checked_at_the_boundary() -> None:
    with pytest.raises(SpecError, match="dp_min 3 is above dp_max 2"):
        validate_document(Policy, {"elastic": {"dp_min": 3, "dp_max": 2}}, "policy.yaml")
    with pytest.raises(SpecError, match="elastic"):
        validate_document(Policy, {"elastic": {"dp_max": 2, "size": 1}}, "policy.yaml")
