"""The orchestrator's decision rule: the threshold, the payback horizon (cut to the steps left),
one move at a time, every decision logged with its reason; and applying what it can."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from modules_helpers import fill_run, make_plan, two_sites

from dmsc.data.db import Database
from dmsc.runtime.control.advisors import (
    Decision,
    DecisionRule,
    Measurements,
    NoDeployment,
    Proposal,
    apply,
    collect,
    decide,
    default_modules,
    orchestrate,
    read_measurements,
)
from dmsc.runtime.control.tasks.task_queue import TaskQueue


def move(gain: float, cost: float, now: float = 1.0, target: str = "stage 1") -> Proposal:
    return Proposal("paths", "move-stage", target, "faster", gain, now, cost)


def one(p: Proposal, rule: DecisionRule, left: int | None = None) -> Decision:
    (d,) = decide([p], rule, left)
    return d


def test_a_move_paid_back_within_the_horizon_is_applied() -> None:
    d = one(move(gain=0.2, cost=100.0), DecisionRule(threshold=0.05, horizon_steps=1000))
    assert d.verdict == "apply" and "500 steps" in d.reason  # 100 s / 0.2 s per step


def test_a_move_not_paid_back_within_the_horizon_is_refused() -> None:
    d = one(move(gain=0.2, cost=100.0), DecisionRule(threshold=0.05, horizon_steps=499))
    assert d.verdict == "refuse" and "beyond the horizon of 499 steps" in d.reason


def test_the_horizon_is_cut_to_the_steps_the_task_has_left() -> None:
    d = one(move(gain=0.2, cost=100.0), DecisionRule(horizon_steps=1000), left=300)
    assert d.verdict == "refuse" and "the steps the task has left" in d.reason


def test_a_gain_under_the_threshold_is_refused_whatever_it_costs() -> None:
    d = one(move(gain=0.04, cost=0.0), DecisionRule(threshold=0.05))
    assert d.verdict == "refuse" and "4.0% of the 1.000 s step" in d.reason
    assert one(move(gain=0.0, cost=0.0), DecisionRule()).verdict == "refuse"


def test_of_several_moves_only_the_largest_gain_is_applied() -> None:
    decisions = decide(
        [move(0.2, 10.0, target="a"), move(0.3, 10.0, target="b"), move(0.01, 1.0, target="c")],
        DecisionRule(),
    )
    assert [d.verdict for d in decisions] == ["refuse", "apply", "refuse"]
    assert "a larger gain is applied (b)" in decisions[0].reason


def test_exceptions_are_raised_and_the_rest_noted() -> None:
    kinds = ["exception", "forecast", "keep", "error"]
    decisions = decide([Proposal("m", k, "t", "r") for k in kinds], DecisionRule())  # type: ignore[arg-type]
    assert [d.verdict for d in decisions] == ["raise", "note", "note", "note"]


def test_every_decision_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dmsc.runtime.control.advisors.orchestrator"):
        decisions = decide([move(0.2, 100.0), Proposal("policy", "exception", "slo:x", "r")],
                           DecisionRule(horizon_steps=10))  # fmt: skip
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    for d, line in zip(decisions, lines, strict=True):
        assert line.startswith(d.verdict) and d.reason in line


class Broken:
    name, description, reads, proposes = "broken", "fails", "nothing", "nothing"

    def propose(self, measurements: Measurements) -> list[Proposal]:
        raise RuntimeError("boom")


class Fine:
    name, description, reads, proposes = "fine", "notes", "nothing", "forecast"

    def propose(self, measurements: Measurements) -> list[Proposal]:
        return [Proposal(self.name, "forecast", "x", "ok")]


def test_a_failing_module_does_not_silence_the_others() -> None:
    m = Measurements(run_id=1, plan=make_plan(two_sites()), taken_s=0.0)
    out = collect([Broken(), Fine()], m)
    assert [(p.module, p.kind) for p in out] == [("broken", "error"), ("fine", "forecast")]
    assert "RuntimeError: boom" in out[0].reason


def test_on_a_slowed_site_the_horizon_decides(tmp_path: Path) -> None:
    """End to end on the database: site-b's devices three times slower. The move pays back in
    about 170 steps: applied within 1000 steps, refused within 100."""
    cluster = two_sites()
    plan = make_plan(cluster)
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, _ = fill_run(db, cluster, plan, steps=12, compute_scale={1: 3.0})
    m = read_measurements(db, run, time.time())
    assert m.remaining_steps == 1000 - 12

    def verdict(horizon: int) -> Decision:
        decisions = orchestrate(default_modules(cluster), m, DecisionRule(horizon_steps=horizon))
        (d,) = [d for d in decisions if d.proposal.module == "paths"]
        return d

    assert verdict(1000).verdict == "apply"
    refused = verdict(100)
    assert refused.verdict == "refuse" and "beyond the horizon of 100 steps" in refused.reason
    with pytest.raises(NoDeployment):
        apply(db, run, [verdict(1000)], time.time())


def test_apply_raises_the_exceptions_into_the_queue(tmp_path: Path) -> None:
    cluster = two_sites()
    plan = make_plan(cluster)
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    slow = 4 * plan.prediction.iteration_time_s
    run, _ = fill_run(db, cluster, plan, steps=12, step_s=lambda s: slow)
    decisions = orchestrate(
        default_modules(cluster), read_measurements(db, run, time.time()), DecisionRule()
    )
    raised = [d for d in decisions if d.verdict == "raise"]
    assert [d.proposal.target for d in raised] == ["slo:step-time"]
    (task,) = apply(db, run, decisions, time.time())
    assert [t.id for t in TaskQueue(db, run).exceptions()] == [task]
    assert apply(db, run, decisions, time.time()) == []  # raised already
    # a breach is a record to read, not work: requeueing it would run it as a training task
    with pytest.raises(KeyError, match="policy exception: there is nothing to run"):
        TaskQueue(db, run).requeue(task)
