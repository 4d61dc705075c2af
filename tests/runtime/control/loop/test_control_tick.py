"""The control loop's tick as a pure function over hand-built snapshots: each objective of the
policy checked against figures computed here, breaches raised once and resolved, the decision
rule's verdicts, one row per new decision, and a move's measured effect."""

from __future__ import annotations

from dataclasses import replace

import pytest
from modules_helpers import make_plan, two_sites

from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors import Measurements, MetricPoint, Proposal, TaskTimes
from dmsc.runtime.control.loop.objectives import Policy
from dmsc.runtime.control.loop.tick import (
    LoopConfig,
    LoopState,
    Snapshot,
    check_slos,
    effect_of,
    tick,
)

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(two_sites())


def _task(i: int, kind: str = "train", state: str = "running", created: float = NOW - 100,
          started: float | None = NOW - 90, finished: float | None = None
          ) -> TaskTimes:  # fmt: skip
    return TaskTimes(i, kind, state, "default", "sync", created, started, finished)


def _measured(plan: Plan, steps: list[float], tasks: tuple[TaskTimes, ...] = (),
              task_id: int | None = 1) -> Measurements:  # fmt: skip
    metrics = tuple(MetricPoint(i, 3.0, s, 100.0) for i, s in enumerate(steps))
    tasks = tasks or (_task(1),)
    return Measurements(1, plan, NOW, task_id, metrics, (), tasks)


def _policy(**slos: object) -> Policy:
    """The objectives ``slos``; a move applies on its first tick (the hysteresis has its own
    tests: test_hysteresis.py); the modules re-run on new steps at any interval (its own test
    below)."""
    return Policy.model_validate({"slos": slos, "confirm_ticks": 1, "replan_interval_s": 0})


class Mover:
    """A module that proposes one move with the given gain (s/step) and cost (s)."""

    name = "mover"
    description = reads = proposes = "test"

    def __init__(self, gain: float, cost: float = 1.0) -> None:
        self.gain, self.cost, self.calls = gain, cost, 0

    def propose(self, m: Measurements) -> list[Proposal]:
        self.calls += 1
        now = m.metrics[-1].step_s
        return [Proposal("mover", "move-stage", "stage 1", "faster", self.gain, now, self.cost)]


def test_step_time_is_the_median_of_the_last_20_steps(plan: Plan) -> None:
    steps = [9.0] * 10 + [0.2] * 10 + [0.6] * 11  # the last 20: ten 0.2 and ten 0.6 -> 0.6
    (b,) = check_slos(Snapshot(_measured(plan, steps)), _policy(step_time_s=0.5))
    assert (b.slo, b.value, b.objective, b.task) == ("step_time_s", 0.6, 0.5, 1)
    assert check_slos(Snapshot(_measured(plan, steps)), _policy(step_time_s=0.6)) == []


def test_the_step_time_is_judged_from_the_third_step(plan: Plan) -> None:
    policy = _policy(step_time_s=0.5)
    assert check_slos(Snapshot(_measured(plan, [3.0, 0.6])), policy) == []  # warm-up
    (b,) = check_slos(Snapshot(_measured(plan, [3.0, 0.6, 0.6])), policy)
    assert b.value == 0.6


def test_a_finished_tasks_old_steps_break_nothing(plan: Plan) -> None:
    old = _task(1, state="done", finished=NOW - 3600)
    snap = Snapshot(_measured(plan, [2.0] * 5, (old,)))
    assert check_slos(snap, _policy(step_time_s=0.5)) == []


def test_inference_p99_queue_wait_and_error_rate(plan: Plan) -> None:
    infer = tuple(
        _task(10 + i, "infer", "done", NOW - 50, NOW - 40, NOW - 40 + lat)
        for i, lat in enumerate([0.1] * 98 + [3.0, 5.0])
    )
    waiting = _task(2, state="queued", created=NOW - 200, started=None)
    failed = (_task(3, "infer", "failed", NOW - 30, NOW - 29, NOW - 28),)
    tasks = (_task(1), waiting, *infer, *failed)
    snap = Snapshot(_measured(plan, [0.1], tasks))
    got = {
        b.slo: b
        for b in check_slos(snap, _policy(infer_p99_s=2.0, queue_wait_s=120, error_rate=0.005))
    }
    # p99 of 100 latencies by nearest rank is the 99th smallest: 3.0
    assert got["infer_p99_s"].value == pytest.approx(3.0)
    assert (got["queue_wait_s"].value, got["queue_wait_s"].task) == (200.0, 2)
    assert got["error_rate"].value == pytest.approx(1 / 101)  # one failed of 101 finished
    assert check_slos(snap, _policy(infer_p99_s=3.0, queue_wait_s=200, error_rate=0.01)) == []


def test_the_served_latencies_judge_inference_p99_where_the_router_keeps_them(plan: Plan) -> None:
    """The gateway's requests are no task rows: the router's latencies (every door's) count,
    and the inference tasks' times are then not counted a second time."""
    served = tuple([0.1] * 98 + [3.0, 5.0])
    (b,) = check_slos(Snapshot(_measured(plan, [0.1]), served=served), _policy(infer_p99_s=2.0))
    assert b.value == pytest.approx(3.0) and "over 100 requests" in b.reason
    slow = (_task(1), _task(10, "infer", "done", NOW - 50, NOW - 40, NOW - 30))
    policy = _policy(infer_p99_s=2.0)
    assert check_slos(Snapshot(_measured(plan, [0.1], slow), served=()), policy) == []
    (b,) = check_slos(Snapshot(_measured(plan, [0.1], slow)), policy)
    assert b.value == pytest.approx(10.0)  # no router's latencies: the tasks' times


def test_link_utilisation_against_the_reserved_path(plan: Plan) -> None:
    cap = plan.paths[0].gbit_s * 1e9 / 8
    b0 = plan.paths[0].after_stage
    snap = Snapshot(_measured(plan, [0.1]), link_rates={b0: 0.9 * cap}, link_capacity={b0: cap})
    (b,) = check_slos(snap, _policy(link_utilisation=0.8))
    assert b.value == pytest.approx(0.9) and f"boundary {b0}->{b0 + 1}" in b.reason
    assert check_slos(snap, _policy(link_utilisation=0.95)) == []


def test_a_breach_is_raised_once_then_resolved(plan: Plan) -> None:
    cfg = LoopConfig(_policy(step_time_s=0.5))
    slow = Snapshot(_measured(plan, [1.0] * 3))
    first = tick(slow, cfg, LoopState(), [])
    assert [b.slo for b in first.raised] == ["step_time_s"]
    # the task at fault: an exception for the exception queue, decided "raise"
    (d,) = first.recorded
    assert (d.proposal.kind, d.proposal.target, d.verdict) == (
        "exception",
        "slo:step_time_s",
        "raise",
    )
    again = tick(replace(slow, measured=_measured(plan, [1.0] * 4)), cfg, first.state, [])
    assert again.raised == () and again.recorded == () and again.breaches
    fast = tick(Snapshot(_measured(plan, [1.0] * 4 + [0.1] * 20)), cfg, again.state, [])
    assert fast.resolved == ("step_time_s",) and fast.breaches == ()


def test_modules_run_when_something_new_was_measured(plan: Plan) -> None:
    mover = Mover(gain=0.5)
    cfg = LoopConfig(_policy())
    snap = Snapshot(_measured(plan, [1.0] * 3))
    first = tick(snap, cfg, LoopState(), [mover])
    (d,) = first.recorded
    assert d.verdict == "apply" and "pays back" in d.reason
    same = tick(snap, cfg, first.state, [mover])
    assert mover.calls == 1 and not same.modules_ran and same.recorded == ()
    # one new step is not enough; ten are: the modules run again, the same verdict is no new row
    one = tick(Snapshot(_measured(plan, [1.0] * 4)), cfg, same.state, [mover])
    assert mover.calls == 1 and not one.modules_ran
    more = tick(Snapshot(_measured(plan, [1.0] * 13)), cfg, one.state, [mover])
    assert mover.calls == 2 and more.modules_ran and more.recorded == ()
    # a training task queued: they run at once, and a changed verdict is a new row
    mover.gain = 0.01
    queued = (_task(1), _task(2, state="queued", started=None))
    changed = tick(Snapshot(_measured(plan, [1.0] * 14, queued)), cfg, more.state, [mover])
    assert mover.calls == 3
    (d,) = changed.recorded
    assert d.verdict == "refuse" and "threshold" in d.reason


def test_the_re_plan_on_new_steps_waits_the_policys_interval(plan: Plan) -> None:
    """At 0.12 s steps ten new steps come every 1.2 s: the modules re-run on them only once
    ``replan_interval_s`` passed since their last run; a new training task or a newly broken
    objective runs them at once."""
    mover = Mover(gain=0.01)  # below the threshold: nothing moves, the calls are counted
    cfg = LoopConfig(Policy.model_validate({"replan_interval_s": 30, "confirm_ticks": 1}))

    def at(steps: int, dt: float, tasks: tuple[TaskTimes, ...] = ()) -> Snapshot:
        m = _measured(plan, [0.12] * steps, tasks)
        return Snapshot(replace(m, taken_s=NOW + dt))

    first = tick(at(3, 0.0), cfg, LoopState(), [mover])
    assert mover.calls == 1 and first.state.ran_s == NOW
    state = first.state
    for k, dt in enumerate((1.2, 2.4, 28.0), start=1):  # ten new steps each, within 30 s
        res = tick(at(3 + 10 * k, dt), cfg, state, [mover])
        assert not res.modules_ran and mover.calls == 1
        state = res.state
    late = tick(at(43, 30.5), cfg, state, [mover])
    assert late.modules_ran and mover.calls == 2 and late.state.ran_s == NOW + 30.5
    queued = (_task(1), _task(2, state="queued", started=None))
    came = tick(at(44, 31.0, queued), cfg, late.state, [mover])  # a task came: at once
    assert came.modules_ran and mover.calls == 3
    slow = LoopConfig(cfg.policy.model_copy(update={"slos": Policy.model_validate(
        {"slos": {"step_time_s": 0.1}}).slos}))  # fmt: skip
    broken = tick(at(45, 32.0, queued), slow, came.state, [mover])  # a new breach: at once
    assert broken.raised and broken.modules_ran and mover.calls == 4
    again = tick(at(46, 33.0, queued), slow, broken.state, [mover])  # still broken: not new
    assert not again.modules_ran and mover.calls == 4


def test_the_policys_move_applies_a_move_below_the_threshold(plan: Plan) -> None:
    small = Mover(gain=0.01, cost=1.0)  # 1% of a 1 s step: below the 5% threshold
    slow = Snapshot(_measured(plan, [1.0] * 3))
    plain = tick(slow, LoopConfig(_policy(step_time_s=0.5)), LoopState(), [small])
    assert {d.verdict for d in plain.decisions if d.proposal.kind == "move-stage"} == {"refuse"}
    moving = LoopConfig(_policy(step_time_s={"max": 0.5, "action": "move"}))
    forced = tick(slow, moving, LoopState(), [small])
    (d,) = [d for d in forced.decisions if d.proposal.kind == "move-stage"]
    assert d.verdict == "apply" and "the policy's action (step_time_s)" in d.reason
    # never beyond the horizon: a cost it would not pay back in 1000 steps stays refused
    costly = tick(slow, moving, LoopState(), [Mover(gain=0.01, cost=100.0)])
    assert {d.verdict for d in costly.decisions if d.proposal.kind == "move-stage"} == {"refuse"}


def test_a_moves_effect_is_the_next_tasks_first_steps(plan: Plan) -> None:
    before = _measured(plan, [1.0] * 10, task_id=1)
    assert effect_of(1, before) is None
    after = _measured(plan, [0.5, 0.7, 0.6, 9.0], (_task(1), _task(2)), task_id=2)
    assert effect_of(1, after) == (2, 0.6)
    assert effect_of(1, _measured(plan, [0.5, 0.7], (_task(2),), task_id=2)) is None
