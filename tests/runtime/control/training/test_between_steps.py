"""A resize handed to a running task (:class:`dmsc.runtime.control.training.resize.Between`),
over a control plane stand-in that records what it is asked: made at the next step boundary
once no inference request is in flight, told back with its outcome, refused with the re-plan's
reason, withdrawn when the task ends first, and a nested task's end gives the outer one back.
The resize itself (checkpoint, restart, load, equal losses) is tests/integration/
test_loop_resize.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from modules_helpers import make_plan, two_sites

from dmsc.runtime.control.training.resize import Asked, Between, check_online


class Plane:
    """What Between reads and changes of the control plane, recorded."""

    def __init__(self, in_flight: list[int]) -> None:
        self.deployment: Any = "old layout"
        self.plan: Any = SimpleNamespace(job=SimpleNamespace(dp=1))
        self.in_flight = in_flight  # requests still in flight at each resize's wait
        self.calls: list[tuple[Any, ...]] = []
        self.inference = self

    @contextlib.contextmanager
    def paused(self, why: str, timeout_s: float) -> Iterator[int]:
        self.calls.append(("paused", why))
        yield self.in_flight.pop(0) if self.in_flight else 0

    def resized(self, dp: int, online: Any = None) -> Any:
        if dp > 4:
            raise ValueError(f"dp: {dp} replicas do not fit cluster 'c'")
        return f"plan at dp {dp}"

    def relayout(self, plan: Any, action: str, why: str, step: int | None = None) -> None:
        self.calls.append(("relayout", plan, action, step))
        self.deployment = f"layout of {plan}"


def test_a_resize_is_made_at_the_next_boundary_with_no_request_in_flight() -> None:
    cp = Plane(in_flight=[2])  # the first boundary still answers two requests
    between, told = Between(cp), []
    assert between.ask(Asked(2, "policy", told.append)) is None  # no task runs: not handed
    with between.running(7):
        assert between(3) is None  # nothing asked
        assert between.ask(Asked(2, "policy", told.append)) == 7
        assert between(3) is None and told == []  # requests in flight: not at this boundary
        assert between(4) == "layout of plan at dp 2"
    assert ("relayout", "plan at dp 2", "loop-dp", 4) in cp.calls
    assert len(told) == 1 and told[0].startswith("applied before step 4")


def test_a_resize_that_cannot_be_made_or_is_not_reached_says_why() -> None:
    cp, told = Plane(in_flight=[]), []
    between = Between(cp)
    with between.running(1):
        between.ask(Asked(8, "policy", told.append))
        assert between(5) is None  # the re-plan refuses: nothing moved
        between.ask(Asked(2, "policy", told.append))
    assert told[0] == "not applied: dp: 8 replicas do not fit cluster 'c'"
    assert told[1] == "withdrawn: training task 1 ended before its next step"
    assert cp.deployment == "old layout"


def test_a_resize_to_the_dp_the_task_shrank_to_already_is_not_made() -> None:
    """The loop sees a lost node's devices short and hands a forced shrink to the task, whose
    session shrank already on its own (:mod:`dmsc.runtime.control.training.shrink`)."""
    cp, told = Plane(in_flight=[]), []
    between = Between(cp)
    with between.running(1):
        between.ask(Asked(1, "devices lost", told.append))
        assert between(6) is None
    assert told == ["not needed before step 6: dp is 1 already"]
    assert not any(c[0] == "relayout" for c in cp.calls)


def test_a_task_run_inside_another_gives_the_outer_one_back() -> None:
    between = Between(Plane(in_flight=[]))
    with between.running(1):
        with between.running(2):
            assert between.ask(Asked(2, "policy", lambda _: None)) == 2
        assert between.ask(Asked(2, "policy", lambda _: None)) == 1


def test_a_re_plan_onto_devices_that_are_not_online_is_not_applied() -> None:
    """A plan that puts replicas where the Ray nodes were lost (lost after the re-plan on the
    devices online, test_online.py) is refused, naming the datacenter."""
    plan = make_plan(two_sites())  # dp 2: stage 0 at site-a, stage 1 at site-b
    check_online(plan, {"site-a": 2, "site-b": 2})
    check_online(plan, None)  # no view: the spec's devices
    with pytest.raises(ValueError, match="2 devices in site-b, which has 1 online"):
        check_online(plan, {"site-a": 2, "site-b": 1})
    cp, told = Plane(in_flight=[]), []
    cp.resized = lambda dp, online=None: plan  # type: ignore[method-assign]
    between = Between(cp)
    with between.running(1):
        between.ask(Asked(2, "devices back", told.append, {"site-a": 2, "site-b": 0}))
        assert between(3) is None
    assert told == ["not applied: dp 2: the re-plan puts 2 devices in site-b, which has 0 online"]
    assert cp.deployment == "old layout"
