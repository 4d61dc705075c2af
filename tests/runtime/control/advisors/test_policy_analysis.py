"""Policy analysis: each objective checked on measurements, and a breach raised into the task
queue's exception queue."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from modules_helpers import fill_run, make_plan, two_sites

from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors import Measurements, Proposal, TaskTimes, read_measurements
from dmsc.runtime.control.advisors.policy import (
    DEDUPE_S,
    PolicyAnalysis,
    SLOs,
    nearest_rank,
    policy_exceptions,
    raise_into_queue,
)
from dmsc.runtime.control.tasks.task_queue import TaskQueue


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(two_sites())


def _db(tmp_path: Path) -> Database:
    return Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")


def test_a_step_time_far_above_the_prediction_is_an_exception(tmp_path: Path, plan: Plan) -> None:
    db = _db(tmp_path)
    predicted = plan.prediction.iteration_time_s
    run, task = fill_run(db, two_sites(), plan, steps=30, step_s=lambda s: 3 * predicted)
    (p,) = PolicyAnalysis().propose(read_measurements(db, run, time.time()))
    assert (p.kind, p.target) == ("exception", "slo:step-time")
    assert p.details["ratio"] == pytest.approx(3.0) and p.details["task"] == task
    assert "3.0x the predicted" in p.reason


def test_a_step_time_within_the_objective_is_not(tmp_path: Path, plan: Plan) -> None:
    db = _db(tmp_path)
    predicted = plan.prediction.iteration_time_s
    # slow at first (warm-up), within 2x over the last 20 steps
    run, _ = fill_run(
        db, two_sites(), plan, steps=30, step_s=lambda s: (5 if s < 10 else 1.5) * predicted
    )
    assert PolicyAnalysis().propose(read_measurements(db, run, time.time())) == []


def _task(i: int, kind: str, state: str, created: float, started: float | None,
          finished: float | None) -> TaskTimes:  # fmt: skip
    return TaskTimes(i, kind, state, "default", "sync", created, started, finished)


def test_inference_latency_p99_by_nearest_rank(plan: Plan) -> None:
    tasks = tuple(_task(i, "infer", "done", 0.0, 10.0, 10.0 + 0.1 * (i + 1)) for i in range(100))
    slow = (*tasks, _task(100, "infer", "done", 0.0, 10.0, 25.0))
    m = Measurements(run_id=1, plan=plan, taken_s=100.0, tasks=slow)
    assert PolicyAnalysis(SLOs(infer_p99_s=12.0)).propose(m) == []  # p99 of 101: the 100th
    (p,) = PolicyAnalysis(SLOs(infer_p99_s=9.0)).propose(m)
    assert p.target == "slo:inference-latency" and p.details["p99_s"] == pytest.approx(10.0)
    assert nearest_rank([3.0, 1.0, 2.0], 50) == 2.0 and nearest_rank([5.0], 99) == 5.0


def test_queue_wait_counts_waiting_tasks_and_recent_starts(plan: Plan) -> None:
    now = 10_000.0
    tasks = (
        _task(1, "train", "queued", now - 400, None, None),  # still waiting, 400 s
        _task(2, "train", "running", now - 1000, now - 500, None),  # waited 500 s, recently
        _task(3, "train", "done", 0.0, 1000.0, 2000.0),  # waited 1000 s, long ago
        _task(4, "train", "queued", now - 10, None, None),
        _task(5, "infer", "done", now - 900, now - 900, now - 899),
    )
    (p,) = PolicyAnalysis(SLOs(queue_wait_s=300)).propose(
        Measurements(run_id=1, plan=plan, taken_s=now, tasks=tasks)
    )
    assert p.target == "slo:queue-wait"
    assert (p.details["late"], p.details["still_waiting"], p.details["longest_s"]) == (2, 1, 500)


def test_a_breach_goes_into_the_exception_queue_once(tmp_path: Path, plan: Plan) -> None:
    db = _db(tmp_path)
    run = db.new_run(plan.model, plan.cluster, {}).id
    p = Proposal("policy", "exception", "slo:step-time", "median step 3x the predicted",
                 details={"ratio": 3.0})  # fmt: skip
    now = time.time()
    task = raise_into_queue(db, run, p, now)
    assert task is not None
    (exc,) = TaskQueue(db, run).exceptions()
    assert (exc.id, exc.kind, exc.state, exc.exception_type) == (
        task,
        "policy",
        "failed",
        "SLOBreach",
    )
    assert exc.error == p.reason and '"ratio": 3.0' in (exc.log_excerpt or "")
    assert raise_into_queue(db, run, p, now + 60) is None  # the same breach, raised a minute ago
    assert raise_into_queue(db, run, p, now + DEDUPE_S + 1) is not None
    assert len(policy_exceptions(db, run)) == 2
    with pytest.raises(ValueError):
        raise_into_queue(db, run, Proposal("traffic", "forecast", "step time", ""), now)
