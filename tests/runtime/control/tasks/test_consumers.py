"""The control plane's consumers of the task queue (:mod:`dmsc.runtime.control.tasks.work_loop`)
in the order ``dmsc up --queue`` names, and the tenants' weights ``dmsc token create --weight``
sets: the real queue, consumers and weights handoff, a stand-in for the plane's training."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from runtime_helpers import local_plan, wait_for

from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.business.auth import create_key
from dmsc.runtime.control.tasks.lanes import Handoff
from dmsc.runtime.control.tasks.task_queue import Policy, TaskQueue
from dmsc.runtime.control.tasks.work_loop import work_queue
from dmsc.runtime.control.training.params import TrainParams, task_params
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.transport.messages import TrainRequest

PLAN = local_plan()


class Plane:
    """What the consumers ask of the control plane; training records the order it ran in."""

    def __init__(self, db: Database, plan: Plan) -> None:
        self.db, self.plan, self.run = db, plan, db.new_run("gpt-mini", "local", {})
        self.cluster = None  # no spec: its tasks are not recalibrated (the row says why)
        self.stopped, self.lock = threading.Event(), threading.Lock()
        self.handoff = Handoff(self.lock)
        self.log, self.weights_lost = logging.getLogger("test"), None
        reg = CollectorRegistry()
        self.m_queue = Gauge("q", "q", registry=reg)
        self.m_tasks = Counter("t", "t", ["kind", "state"], registry=reg)
        self.ran: list[int] = []

    @property
    def inference(self) -> Any:
        return self

    def sync_versions(self) -> None:
        pass

    def train_params(self, req: TrainRequest) -> TrainParams:
        return task_params(req, self.plan)

    def run_task(self, task_id: int, params: TrainParams, lend: Any = None) -> tuple[Any, int]:
        self.ran.append(task_id)
        return TrainReport(params.steps), 0


def _order(
    tmp_path: Path, policy: Policy, tasks: list[dict[str, Any]], **weights: float
) -> list[int]:
    """The ids of ``tasks`` (queued before the consumers start) in the order they ran."""
    db = Database(f"sqlite:///{tmp_path / f'{policy}.sqlite'}")
    for tenant, weight in weights.items():
        create_key(db, tenant, ["submit"], weight=weight)
    cp = Plane(db, PLAN)
    queue = TaskQueue(db, cp.run.id)
    ids = [queue.submit("train", {"steps": 1}, **t).id for t in tasks]
    threading.Thread(target=work_queue, args=(cp, queue, policy), daemon=True).start()
    try:
        wait_for(lambda: len(cp.ran) == len(ids), 30, "the tasks")
    finally:
        cp.stopped.set()
    return [ids.index(i) for i in cp.ran]


def test_fcfs_runs_in_arrival_order(tmp_path: Path) -> None:
    tasks = [{"priority": p} for p in (0, 5, 1)]
    assert _order(tmp_path, "fcfs", tasks) == [0, 1, 2]


def test_priority_runs_the_highest_first(tmp_path: Path) -> None:
    tasks = [{"priority": p} for p in (0, 5, 1)]
    assert _order(tmp_path, "priority", tasks) == [1, 2, 0]


@pytest.mark.parametrize(("bob", "order"), [(1.0, [0, 3, 1, 4, 2]), (2.0, [0, 3, 4, 1, 2])])
def test_fair_shares_by_the_tenants_weights(tmp_path: Path, bob: float, order: list[int]) -> None:
    """Alice queued three tasks before Bob's two: with equal weights they alternate; with
    Bob's weight 2 (``dmsc token create --weight 2``) he gets two turns to her one."""
    tasks = [{"tenant": "alice"}] * 3 + [{"tenant": "bob"}] * 2
    assert _order(tmp_path, "fair", tasks, alice=1.0, bob=bob) == order
