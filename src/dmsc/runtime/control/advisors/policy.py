"""Policy analysis: the run's service-level objectives checked on the measurements, each breach
proposed as an exception for the exception queue.

Three objectives (:class:`SLOs`, defaults stated there):

- inference latency: the 99th percentile (nearest rank) of the finished inference tasks' run
  times, start to finish, however many tokens each asked for;
- step time against the prediction: the median of the last ``recent_steps`` training steps over
  the predicted iteration time of the job the task ran (:meth:`Measurements.prediction`; not
  checked when that is not comparable): a slower run than planned: a slow link or device, a
  straggler, a mis-calibrated cost model;
- queue wait: how long a training task waits before it starts: any still queued past the
  objective, or started within the last ``window_s`` after waiting past it.

A breach goes into the exception queue (:func:`raise_into_queue`) as a task of kind ``policy``,
failed with exception type ``SLOBreach`` through the task queue's own :meth:`TaskQueue.fail`,
so that ``dmsc tasks list --state failed`` and the gateway's ``/v1/exceptions`` show it beside the
tasks that failed; the same breach is not raised twice within ``DEDUPE_S``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

from sqlalchemy import select

from dmsc.data.db import Database, TaskRecord
from dmsc.runtime.control.advisors.base import Measurements, Proposal, unix_s
from dmsc.runtime.control.tasks.task_queue import TaskQueue

POLICY_TASK_KIND = "policy"
DEDUPE_S = 3600.0  # a breach raised within the last hour is not raised again


class SLOBreach(Exception):
    """A service-level objective the run breaks (the exception type the queue records)."""


@dataclass(frozen=True)
class SLOs:
    """The objectives policy analysis checks."""

    infer_p99_s: float = 10.0  # inference latency, start to finish, 99th percentile
    step_ratio: float = 2.0  # median measured step time / predicted, at most
    queue_wait_s: float = 300.0  # seconds a training task may wait in the queue
    recent_steps: int = 20  # the steps the step-time median is over
    window_s: float = 3600.0  # started tasks whose queue wait counts: those started this recently


def nearest_rank(values: list[float], pct: float) -> float:
    """The ``pct`` percentile by nearest rank (a value of the list, no interpolation)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


class PolicyAnalysis:
    """Checks the run's objectives; proposes an exception per breach."""

    name = "policy"
    description = (
        "checks the SLOs: inference latency p99, step time against the prediction, queue wait; "
        "raises each breach into the exception queue"
    )
    reads = "inference and training tasks (created, started, finished), training metrics, plan"
    proposes = "exception"

    def __init__(self, slos: SLOs | None = None) -> None:
        self.slos = slos or SLOs()

    def propose(self, measurements: Measurements) -> list[Proposal]:
        return [
            p
            for p in (
                self._latency(measurements),
                self._step_time(measurements),
                self._queue_wait(measurements),
            )
            if p is not None
        ]

    def _exception(self, target: str, reason: str, **details: float | int | str) -> Proposal:
        return Proposal(self.name, "exception", target, reason, details=dict(details))

    def _latency(self, m: Measurements) -> Proposal | None:
        runs = [t.run_s for t in m.tasks if t.kind == "infer" and t.state == "done"]
        latencies = [r for r in runs if r is not None]
        if not latencies:
            return None
        p99 = nearest_rank(latencies, 99)
        if p99 <= self.slos.infer_p99_s:
            return None
        return self._exception(
            "slo:inference-latency",
            f"inference latency p99 {p99:.2f} s over {len(latencies)} requests, above the "
            f"objective of {self.slos.infer_p99_s:g} s",
            p99_s=p99,
            requests=len(latencies),
            objective_s=self.slos.infer_p99_s,
        )

    def _step_time(self, m: Measurements) -> Proposal | None:
        recent = [p.step_s for p in m.metrics[-self.slos.recent_steps :]]
        ran = m.prediction()  # of the job the measured task ran; None: not comparable
        predicted = ran.step_s
        if not recent or predicted is None or predicted <= 0:
            return None
        median = statistics.median(recent)
        ratio = median / predicted
        if ratio <= self.slos.step_ratio:
            return None
        what = "" if ran.basis == "the plan's" else f" ({ran.basis})"
        return self._exception(
            "slo:step-time",
            f"median step {median:.3f} s over the last {len(recent)} steps is {ratio:.1f}x "
            f"the predicted {predicted:.3f} s{what} (objective: at most "
            f"{self.slos.step_ratio:g}x)",
            median_step_s=median,
            predicted_s=predicted,
            ratio=ratio,
            objective_ratio=self.slos.step_ratio,
            task=m.task_id or 0,
        )

    def _queue_wait(self, m: Measurements) -> Proposal | None:
        now, slo = m.taken_s, self.slos.queue_wait_s
        waiting = [
            t.queue_wait_s(now) for t in m.tasks if t.kind == "train" and t.state == "queued"
        ]
        started = [
            t.queue_wait_s(now)
            for t in m.tasks
            if t.kind == "train"
            and t.started_s is not None
            and now - t.started_s <= self.slos.window_s
        ]
        late = [w for w in waiting + started if w > slo]
        if not late:
            return None
        still = sum(1 for w in waiting if w > slo)
        return self._exception(
            "slo:queue-wait",
            f"{len(late)} training tasks waited longer than {slo:g} s in the queue "
            f"({still} still waiting; the longest {max(late):.0f} s)",
            late=len(late),
            still_waiting=still,
            longest_s=max(late),
            objective_s=slo,
        )


def raised_recently(db: Database, run_id: int, target: str, now_s: float) -> int | None:
    """The exception task that raised ``target`` within ``DEDUPE_S`` of ``now_s``, if any (it is
    not raised again: a dry run says so as the real one does)."""
    for task in TaskQueue(db, run_id).exceptions():
        if task.kind != POLICY_TASK_KIND or task.finished_at is None:
            continue
        same = json.loads(task.params_json or "{}").get("target") == target
        if same and now_s - (unix_s(task.finished_at) or 0.0) < DEDUPE_S:
            return task.id
    return None


def raise_into_queue(db: Database, run_id: int, proposal: Proposal, now_s: float) -> int | None:
    """Put an exception proposal into the run's exception queue: a ``policy`` task, failed as
    :class:`SLOBreach` with the proposal's reason (and its details in the log excerpt). Returns
    the task's id, or None when the same target was raised within ``DEDUPE_S`` of ``now_s``."""
    if proposal.kind != "exception":
        raise ValueError(f"only exceptions go into the exception queue, not a {proposal.kind}")
    if raised_recently(db, run_id, proposal.target, now_s) is not None:
        return None
    queue = TaskQueue(db, run_id)
    params = {"module": proposal.module, "target": proposal.target}
    # Created failed, never queued: a queue worker must not claim it for a moment.
    task_id = db.new_task(run_id, POLICY_TASK_KIND, params, state="failed").id
    queue.fail(
        task_id,
        SLOBreach(proposal.reason),
        log=proposal.reason + "\n" + json.dumps(proposal.details),
        retry=False,
    )
    return task_id


def policy_exceptions(db: Database, run_id: int) -> list[TaskRecord]:
    """The run's exceptions that policy analysis raised, oldest first."""
    with db.sessions() as s:
        q = select(TaskRecord).where(
            TaskRecord.run_id == run_id,
            TaskRecord.kind == POLICY_TASK_KIND,
            TaskRecord.state == "failed",
        )
        return list(s.scalars(q.order_by(TaskRecord.id)))
