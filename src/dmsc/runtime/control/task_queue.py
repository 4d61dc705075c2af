"""Task management: a persistent queue in the data layer, with policies and an exception queue.

Tasks wait in the ``tasks`` table (state ``queued``), so a restart of the control plane loses
none. :meth:`TaskQueue.claim` takes the next one under a policy, atomically (a conditional
UPDATE: two claimers never get the same task):

- ``fcfs``: first come, first served;
- ``priority``: highest priority first (an urgent task inserted late jumps the queue), FCFS within;
- ``fair``: weighted fair share between tenants: the tenant with the least work served per unit
  of weight goes next.

Two lanes keep long tasks (``async``) from blocking short ones (``sync``). A failed or timed-out
task is retried until ``max_attempts``, then parked in the exception queue (state ``failed``)
with its exception type and a log excerpt, until someone requeues it.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Literal

from sqlalchemy import func, select, update

from dmsc.data.db import Database, TaskRecord

Policy = Literal["fcfs", "priority", "fair"]
LOG_EXCERPT = 2000


class TaskQueue:
    """Queue operations over a :class:`Database`."""

    def __init__(self, db: Database, run_id: int) -> None:
        self.db = db
        self.run_id = run_id

    def submit(
        self,
        kind: str,
        params: dict[str, Any],
        tenant: str = "default",
        priority: int = 0,
        weight: float = 1.0,
        lane: str = "sync",
        max_attempts: int = 3,
    ) -> TaskRecord:
        if weight <= 0 or max_attempts <= 0:
            raise ValueError("weight and max_attempts must be positive")
        return self.db.add(
            TaskRecord(
                run_id=self.run_id,
                kind=kind,
                params_json=json.dumps(params),
                tenant=tenant,
                priority=priority,
                weight=weight,
                lane=lane,
                max_attempts=max_attempts,
            )
        )

    def _served(self) -> dict[str, float]:
        """Work served per tenant (claimed tasks), divided by the tenant's weight."""
        with self.db.sessions() as s:
            rows = s.execute(
                select(TaskRecord.tenant, func.count(), func.max(TaskRecord.weight))
                .where(TaskRecord.run_id == self.run_id, TaskRecord.state != "queued")
                .group_by(TaskRecord.tenant)
            ).all()
        return {tenant: n / w for tenant, n, w in rows}

    def claim(self, policy: Policy = "priority", lane: str = "sync") -> TaskRecord | None:
        """The next task under ``policy``, now ``running``; None when the lane is empty."""
        for _ in range(8):  # another claimer may win the race for a candidate: try the next
            with self.db.sessions() as s:
                q = select(TaskRecord).where(
                    TaskRecord.run_id == self.run_id,
                    TaskRecord.state == "queued",
                    TaskRecord.lane == lane,
                )
                waiting = list(s.scalars(q))
            if not waiting:
                return None
            if policy == "fcfs":
                task = min(waiting, key=lambda t: t.id)
            elif policy == "priority":
                task = min(waiting, key=lambda t: (-t.priority, t.id))
            elif policy == "fair":
                served = self._served()
                task = min(waiting, key=lambda t: (served.get(t.tenant, 0.0), -t.priority, t.id))
            else:
                raise ValueError(f"unknown policy {policy!r}")
            with self.db.sessions() as s, s.begin():
                result: Any = s.execute(
                    update(TaskRecord)
                    .where(TaskRecord.id == task.id, TaskRecord.state == "queued")
                    .values(
                        state="running",
                        started_at=dt.datetime.now(dt.UTC),
                        attempts=TaskRecord.attempts + 1,
                    )
                )
                won = result.rowcount
            if won:
                with self.db.sessions() as s:
                    return s.get(TaskRecord, task.id)
        return None

    def complete(self, task_id: int) -> None:
        self.db.set_task_state(task_id, "done")

    def fail(self, task_id: int, exc: BaseException | str, log: str = "") -> str:
        """Record a failure: back to ``queued`` while attempts remain, else ``failed`` (the
        exception queue). Returns the new state."""
        kind = exc if isinstance(exc, str) else type(exc).__name__
        with self.db.sessions() as s, s.begin():
            task = s.get(TaskRecord, task_id)
            if task is None:
                raise KeyError(f"no task {task_id}")
            task.exception_type = kind
            task.log_excerpt = (log or str(exc))[-LOG_EXCERPT:]
            task.error = str(exc)
            if task.attempts < task.max_attempts:
                task.state = "queued"
            else:
                task.state = "failed"
                task.finished_at = dt.datetime.now(dt.UTC)
            return task.state

    def exceptions(self) -> list[TaskRecord]:
        with self.db.sessions() as s:
            q = (
                select(TaskRecord)
                .where(TaskRecord.run_id == self.run_id, TaskRecord.state == "failed")
                .order_by(TaskRecord.id)
            )
            return list(s.scalars(q))

    def requeue(self, task_id: int) -> None:
        """Manual requeue from the exception queue, with a fresh set of attempts."""
        with self.db.sessions() as s, s.begin():
            task = s.get(TaskRecord, task_id)
            if task is None or task.state != "failed":
                raise KeyError(f"task {task_id} is not in the exception queue")
            task.state, task.attempts, task.finished_at = "queued", 0, None

    def depth(self, lane: str | None = None) -> int:
        with self.db.sessions() as s:
            q = (
                select(func.count())
                .select_from(TaskRecord)
                .where(TaskRecord.run_id == self.run_id, TaskRecord.state == "queued")
            )
            if lane is not None:
                q = q.where(TaskRecord.lane == lane)
            return int(s.scalar(q) or 0)
