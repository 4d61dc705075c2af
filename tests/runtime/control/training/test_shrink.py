"""The decision of a task that lost replicas for good (:func:`dmsc.runtime.control.training.
shrink.decide`): which dp is left and when the shrink is refused. The shrink itself (re-plan,
restart from the newest checkpoint that verifies, equal losses) is tests/integration/
test_ray_shrink.py's."""

from __future__ import annotations

from modules_helpers import make_plan, two_sites

from dmsc.runtime.control.training.shrink import decide
from dmsc.spec import JobSpec

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
