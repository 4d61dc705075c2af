"""Task management: a persistent queue in the data layer, with policies and an exception queue.

Tasks wait in the ``tasks`` table (state ``queued``), so a restart of the control plane loses
none. :meth:`TaskQueue.claim` takes the next one under a policy, atomically (a conditional
UPDATE: two claimers never get the same task):

- ``fcfs``: first come, first served;
- ``priority``: highest priority first (an urgent task inserted late jumps the queue), FCFS within;
- ``fair``: weighted fair share between tenants: the tenant with the least work served per unit
  of weight goes next (a tenant's weight: ``dmsc token create --weight``).

The control plane claims in the policy ``dmsc up --queue`` names (``priority`` by default).

Two lanes keep long tasks (``async``) from blocking short ones (``sync``): each has its own
consumer, and a long task's session lends the weights to a waiting short one between two steps
(:mod:`.lanes`). A failed or timed-out
task is retried until ``max_attempts``, then parked in the exception queue (state ``failed``)
with its exception type and a log excerpt, until someone requeues it.

Quotas: a tenant may have at most ``max_queued_tasks`` tasks and ``max_queued_steps`` training
steps waiting in a run; :meth:`TaskQueue.submit` refuses more with :class:`QuotaExceeded`,
which names the limit. (Counted and inserted under one lock: the control plane, gateway included,
is the one process that submits to its run.)

Cancelling (:meth:`TaskQueue.cancel`): a queued task is ``cancelled`` at once; a running one
becomes ``cancelling``, its training session stops between two steps (it asks
:func:`cancel_requested`), checkpoints where it stopped and the task ends ``cancelled``.

Orphans (:meth:`TaskQueue.adopt_orphans`, when a control plane starts): tasks that an earlier,
stopped run of the same database left queued or running move into the new run, or fail with the
reason when they cannot run there; a cancel that a crash cut short ends ``cancelled``.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any, Literal

from sqlalchemy import func, select, update

from dmsc.data.db import Database, RunRecord, TaskRecord, TenantRecord
from dmsc.runtime.business.queueing import QuotaExceeded, TaskFinished

Policy = Literal["fcfs", "priority", "fair"]
LOG_EXCERPT = 2000
MAX_QUEUED_TASKS = 16  # per tenant and run
MAX_QUEUED_STEPS = 100_000  # training steps per tenant and run (params["steps"])
FINISHED = ("done", "failed", "cancelled")
RUNNABLE = ("train",)  # the kinds the queue runs (a "policy" exception is only a record)


def _steps(params: dict[str, Any]) -> int:
    steps = params.get("steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, not {steps!r}")
    return steps


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def cancel_requested(db: Database, task_id: int) -> bool:
    """Whether someone asked the running task ``task_id`` to stop (its state is ``cancelling``)."""
    with db.sessions() as s:
        return s.scalar(select(TaskRecord.state).where(TaskRecord.id == task_id)) == "cancelling"


class TaskQueue:
    """Queue operations over a :class:`Database`, with per-tenant quotas on queued work."""

    def __init__(
        self,
        db: Database,
        run_id: int,
        max_queued_tasks: int = MAX_QUEUED_TASKS,
        max_queued_steps: int = MAX_QUEUED_STEPS,
    ) -> None:
        if max_queued_tasks <= 0 or max_queued_steps <= 0:
            raise ValueError("max_queued_tasks and max_queued_steps must be positive")
        self.db = db
        self.run_id = run_id
        self.max_queued_tasks = max_queued_tasks
        self.max_queued_steps = max_queued_steps
        self._submitting = threading.Lock()  # count and insert as one

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
        """Queue a task; :class:`QuotaExceeded` when the tenant's queued tasks or steps would
        pass the queue's quotas."""
        if weight <= 0 or max_attempts <= 0:
            raise ValueError("weight and max_attempts must be positive")
        steps = _steps(params)
        with self._submitting:
            self._check_quota(tenant, steps)
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

    def _check_quota(self, tenant: str, steps: int) -> None:
        with self.db.sessions() as s:
            waiting = list(
                s.scalars(
                    select(TaskRecord.params_json).where(
                        TaskRecord.run_id == self.run_id,
                        TaskRecord.tenant == tenant,
                        TaskRecord.state == "queued",
                    )
                )
            )
        if len(waiting) >= self.max_queued_tasks:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {len(waiting)} queued tasks, the quota of queued tasks "
                f"per tenant ({self.max_queued_tasks}): wait for some to run, or cancel some"
            )
        queued = sum(int(json.loads(p).get("steps", 0) or 0) for p in waiting)
        if queued + steps > self.max_queued_steps:
            raise QuotaExceeded(
                f"tenant {tenant!r} would have {queued + steps} queued steps ({queued} waiting "
                f"+ {steps}), over the quota of queued steps per tenant ({self.max_queued_steps})"
            )

    def _served(self) -> dict[str, float]:
        """Work served per tenant (claimed tasks), divided by the tenant's weight (its own,
        ``dmsc token create --weight``; else its tasks' heaviest)."""
        with self.db.sessions() as s:
            rows = s.execute(
                select(TaskRecord.tenant, func.count(), func.max(TaskRecord.weight))
                .where(TaskRecord.run_id == self.run_id, TaskRecord.state != "queued")
                .group_by(TaskRecord.tenant)
            ).all()
            weights = {t.name: t.weight for t in s.scalars(select(TenantRecord))}
        return {tenant: n / weights.get(tenant, w) for tenant, n, w in rows}

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

    def complete(self, task_id: int, cancelled: bool = False) -> None:
        """The task ended: ``done``, or ``cancelled`` when it stopped on a cancel request."""
        self.db.set_task_state(task_id, "cancelled" if cancelled else "done")

    def cancel(self, task_id: int) -> str:
        """Cancel a task; returns its new state: ``cancelled`` (it was queued) or ``cancelling``
        (it runs: it stops between two steps and ends ``cancelled``). KeyError for an unknown
        task, :class:`TaskFinished` for one that is over."""
        for _ in range(8):  # the task may change state under us (claimed, requeued): look again
            with self.db.sessions() as s, s.begin():
                queued: Any = s.execute(
                    update(TaskRecord)
                    .where(TaskRecord.id == task_id, TaskRecord.state == "queued")
                    .values(state="cancelled", finished_at=_now())
                )
                if queued.rowcount:
                    return "cancelled"
                running: Any = s.execute(
                    update(TaskRecord)
                    .where(TaskRecord.id == task_id, TaskRecord.state == "running")
                    .values(state="cancelling")
                )
                if running.rowcount:
                    return "cancelling"
                state = s.scalar(select(TaskRecord.state).where(TaskRecord.id == task_id))
            if state is None:
                raise KeyError(f"no task {task_id}")
            if state == "cancelling":
                return state
            if state in FINISHED:
                raise TaskFinished(
                    f"task {task_id} is {state}: only queued and running tasks cancel"
                )
        raise RuntimeError(f"task {task_id} keeps changing state; try again")

    def fail(
        self, task_id: int, exc: BaseException | str, log: str = "", retry: bool = True
    ) -> str:
        """Record a failure: back to ``queued`` while attempts remain (and ``retry``), else
        ``failed`` (the exception queue); a task asked to cancel ends ``cancelled``. Returns the
        new state."""
        kind = exc if isinstance(exc, str) else type(exc).__name__
        with self.db.sessions() as s, s.begin():
            task = s.get(TaskRecord, task_id)
            if task is None:
                raise KeyError(f"no task {task_id}")
            task.exception_type = kind
            task.log_excerpt = (log or str(exc))[-LOG_EXCERPT:]
            task.error = str(exc)
            if task.state == "cancelling":
                task.state = "cancelled"
            elif retry and task.attempts < task.max_attempts:
                task.state = "queued"
            else:
                task.state = "failed"
            if task.state != "queued":
                task.finished_at = _now()
            return task.state

    def adopt_orphans(self, model: str) -> dict[str, list[int]]:
        """Settle what earlier runs left behind, at the start of this run (serving ``model``):
        training tasks still queued or running in a stopped run move here as fresh tasks (same
        model) or fail with the reason (another model; another kind of task), and this run's
        cancel requests that a crash cut short end ``cancelled``. Returns the ids by outcome."""
        out: dict[str, list[int]] = {"requeued": [], "failed": [], "cancelled": []}
        with self.db.sessions() as s, s.begin():
            stopped = {
                r.id: r.model
                for r in s.scalars(
                    select(RunRecord).where(
                        RunRecord.id != self.run_id, RunRecord.status != "running"
                    )
                )
            }
            left = s.scalars(
                select(TaskRecord)
                .where(
                    TaskRecord.run_id.in_(list(stopped)),
                    TaskRecord.state.in_(("queued", "running", "cancelling")),
                )
                .order_by(TaskRecord.id)
            )
            for task in left:
                old_run, was = task.run_id, task.state
                if task.kind == "train" and was != "cancelling" and stopped[old_run] == model:
                    params = json.loads(task.params_json)
                    params.pop("first_step", None)  # its progress stayed in the old run
                    task.params_json = json.dumps(params)
                    task.run_id, task.state, task.started_at = self.run_id, "queued", None
                    out["requeued"].append(task.id)
                    continue
                if was == "cancelling":
                    task.state = "cancelled"
                    out["cancelled"].append(task.id)
                else:
                    task.state = "failed"
                    task.exception_type = "Orphaned"
                    task.error = task.log_excerpt = (
                        f"{was} in run {old_run} ({stopped[old_run]}) when it stopped; run "
                        f"{self.run_id} serves {model}"
                        + ("" if task.kind == "train" else f" and runs no {task.kind} tasks")
                    )
                    out["failed"].append(task.id)
                task.finished_at = _now()
            for task in s.scalars(
                select(TaskRecord).where(
                    TaskRecord.run_id == self.run_id, TaskRecord.state == "cancelling"
                )
            ):  # its session died with the control plane: what it checkpointed stays
                task.state, task.finished_at = "cancelled", _now()
                out["cancelled"].append(task.id)
        return out

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
            if task.kind not in RUNNABLE:  # a policy breach: a record to read, not work to run
                raise KeyError(
                    f"task {task_id} is a {task.kind} exception: there is nothing to run"
                )
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
