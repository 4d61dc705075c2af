"""The control plane's loop over queued tasks (training, and batches of inference requests:
:mod:`.infer_batch`), and how a task's end is recorded.

Every task the loop claims reaches a terminal state (or, with attempts left, the queue again),
whatever the disk does. A write the database refuses (a full disk: SQLite's "database or disk is
full") does not end the loop, which would leave its task ``running`` and a cancel ``cancelling``
for good: the end is logged and written again every :data:`RETRY_S` until the database takes it
or the control plane stops (then the next start settles it: running tasks go back to the queue,
cancel requests end ``cancelled``).

A task fails at once, without the retries a passing fault earns, when a retry would meet the
same wall (:data:`PERMANENT`): no checkpoint of its own verifies, the disk is full
(:class:`~dmsc.runtime.compute.checkpoints.DiskFull`, with the path and the space left), or the
tenant's checkpoints use up its quota (:class:`~..training.retention.QuotaExceeded`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from prometheus_client import Counter, Gauge

from dmsc.data.db import RunRecord, StorageError
from dmsc.planner.plan import Plan
from dmsc.runtime.compute.checkpoints import DiskFull
from dmsc.runtime.control.launch.fallback import NoGoodCheckpoint
from dmsc.runtime.control.tasks import lanes
from dmsc.runtime.control.tasks.task_queue import Policy, TaskQueue
from dmsc.runtime.control.training import recalibration
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.control.training.retention import QuotaExceeded
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.runtime.transport.rpc import parse
from dmsc.spec import ClusterSpec

RETRY_S = 2.0
PERMANENT: tuple[type[BaseException], ...] = (NoGoodCheckpoint, DiskFull, QuotaExceeded)


class Versions(Protocol):
    """What the loop asks of the replicas between tasks: load the versions they should serve."""

    def sync_versions(self) -> None: ...


class Batches(Protocol):
    """Runs a queued batch of inference requests (:class:`.infer_batch.Batches`): its answers
    and whether a cancel stopped it."""

    def run(self, task_id: int, params: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]: ...


class Plane(Protocol):
    """What the loop asks of the control plane."""

    batches: Batches

    stopped: threading.Event
    log: logging.Logger
    lock: threading.Lock
    handoff: lanes.Handoff
    weights_lost: str | None
    m_queue: Gauge
    m_tasks: Counter
    run: RunRecord
    plan: Plan
    cluster: ClusterSpec | None  # the plan's cluster spec, when known (for recalibration)

    @property
    def inference(self) -> Versions: ...

    def train_params(self, req: TrainRequest) -> TrainParams: ...

    def run_task(
        self, task_id: int, params: TrainParams, lend: Callable[[], bool] | None = None
    ) -> tuple[TrainReport, int]: ...


def _params(cp: Plane, stored: dict[str, Any]) -> TrainParams:
    """The task's parameters as its submit resolved them (neither the planner nor the corpus
    runs again); a request queued as it came (a test's, an older database's) resolved now."""
    if TrainParams.resolved(stored):
        return TrainParams.from_stored(stored)
    return cp.train_params(parse(TrainRequest, stored))


def record_end(
    queue: TaskQueue,
    task_id: int,
    stopped: threading.Event,
    log: logging.Logger,
    exc: BaseException | None = None,
    cancelled: bool = False,
    retry: bool = True,
) -> str | None:
    """Record that the task ended (``exc``: it failed; retried while ``retry`` and attempts
    remain), writing again while the database refuses; its new state, or None when the control
    plane stopped before the database took it."""
    while True:
        try:
            if exc is None:
                queue.complete(task_id, cancelled=cancelled)
                return "cancelled" if cancelled else "done"
            return queue.fail(task_id, exc, retry=retry and not isinstance(exc, PERMANENT))
        except StorageError as err:
            log.error(
                "cannot record the end of task %d (trying again in %g s): %s",
                task_id,
                RETRY_S,
                err,
                extra={"task_id": task_id},
            )
            if stopped.wait(RETRY_S):
                return None


def work_queue(cp: Plane, queue: TaskQueue, policy: Policy = "priority") -> None:
    """Run queued training tasks until the plane stops: one consumer per lane (a thread each,
    this one the last lane's), each claiming its lane's next task under ``policy``."""
    handoff = cp.handoff
    for lane in lanes.LANES[:-1]:
        args = (cp, queue, lane, policy, handoff)
        threading.Thread(target=work_lane, args=args, name=f"lane-{lane}", daemon=True).start()
    work_lane(cp, queue, lanes.LANES[-1], policy, handoff)


class Consumers:
    """The control plane's consumers of the queue (the daemon starts them at once): they run
    once, however often :meth:`run` is called."""

    def __init__(self, cp: Plane, policy: Policy = "priority") -> None:
        self.cp, self.policy = cp, policy
        self._running = threading.Lock()  # held while they run

    def run(self, queue: TaskQueue) -> None:
        """Run them until the plane stops (when they run already: wait for the stop)."""
        if not self._running.acquire(blocking=False):
            self.cp.stopped.wait()
            return
        work_queue(self.cp, queue, self.policy)

    @property
    def running(self) -> bool:
        return self._running.locked()

    def drive(self, queue: TaskQueue, lane: str, until: Callable[[], bool]) -> None:
        """No consumer runs (a plane in a test, or one whose daemon has not started them yet):
        the caller's thread works ``lane`` until ``until()`` (its own task ended); without
        syncing the replicas' versions between tasks, which is the consumers' work."""
        while not until() and not self.cp.stopped.is_set() and not self.running:
            if not run_next(self.cp, queue, lane, self.policy, self.cp.handoff):
                self.cp.stopped.wait(0.05)


def work_lane(
    cp: Plane, queue: TaskQueue, lane: str, policy: Policy, handoff: lanes.Handoff
) -> None:
    """Run the lane's queued tasks until the plane stops; between tasks, when no task holds
    the weights, load the model versions the replicas should serve."""
    while not cp.stopped.is_set():
        if not cp.lock.locked():  # a task trains: its weights must stay (it syncs after)
            try:
                cp.inference.sync_versions()
            except Exception as exc:  # a bad checkpoint must not stop the queue
                cp.log.warning("version sync failed: %s", exc)
        try:
            ran = run_next(cp, queue, lane, policy, handoff)
        except StorageError as exc:  # a full disk, say: wait for room
            cp.log.error("cannot read the task queue (trying again in %g s): %s", RETRY_S, exc)
            cp.stopped.wait(RETRY_S)
            continue
        if not ran:
            cp.stopped.wait(0.5)


def run_next(
    cp: Plane, queue: TaskQueue, lane: str, policy: Policy, handoff: lanes.Handoff
) -> bool:
    """Claim the lane's next task under ``policy`` and run it to its end (or back to the
    queue, with attempts left); whether there was one."""
    cp.m_queue.set(queue.depth())
    task = queue.claim(policy, lane=lane)
    if task is None:
        return False
    extra = {"task_id": task.id, "run": cp.run.id, "lane": lane}
    if task.kind == "infer":  # a batch of inference requests: no weights held, nothing lent
        return _run_batch(cp, queue, task.id, json.loads(task.params_json), extra)
    try:
        params = _params(cp, json.loads(task.params_json))
        nests, fits = lanes.nestable(params, cp.plan.job.dp), lanes.fits(params, cp.plan.job.dp)
        lend = partial(handoff.lend, fits) if lane == lanes.LENDS and nests else None
        with handoff.hold(params if lane != lanes.LENDS and nests else None):
            report, _ = cp.run_task(task.id, params, lend)
    except Exception as exc:  # isolate it in the exception queue (or retry)
        # a task whose weights are lost fails at once: a retry would meet the same
        state = record_end(queue, task.id, cp.stopped, cp.log, exc, retry=not cp.weights_lost)
        cp.log.warning("task failed: %s", exc, extra=extra)
    else:  # its traces refit the cluster spec (before its end is told: the fit is there then)
        args = (queue.db, cp.run.id, task.id, cp.plan, cp.cluster, params, report, cp.log)
        recalibration.after_task(*args)
        state = record_end(queue, task.id, cp.stopped, cp.log, cancelled=report.cancelled)
        cp.log.info(f"task {state}", extra=extra)
    if state is not None:
        cp.m_tasks.labels("train", state).inc()
    return True


def _run_batch(
    cp: Plane, queue: TaskQueue, task_id: int, params: dict[str, Any], extra: dict[str, Any]
) -> bool:
    try:
        _, cancelled = cp.batches.run(task_id, params)
    except Exception as exc:
        state = record_end(queue, task_id, cp.stopped, cp.log, exc)
        cp.log.warning("task failed: %s", exc, extra=extra)
    else:
        state = record_end(queue, task_id, cp.stopped, cp.log, cancelled=cancelled)
        cp.log.info(f"task {state}", extra=extra)
    if state is not None:
        cp.m_tasks.labels("infer", state).inc()
    return True
