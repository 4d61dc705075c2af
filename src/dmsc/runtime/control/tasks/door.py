"""The one way in for a queued task: both doors, ``dmsc train`` (the ``Train`` call) and the
gateway's ``POST /v1/tasks``, hand the same :class:`~dmsc.runtime.transport.messages.TrainRequest`
to :meth:`Door.submit`, which resolves it once (the control plane's check: plan, data roots, the
corpus, a resized plan) into the task's stored parameters and queues it under the request's
priority and lane. The gateway answers once it is queued; the Train call then waits
(:meth:`Door.wait`) until a consumer of the queue ran it, and its caller going away cancels it.
A batch of inference requests (:mod:`.infer_batch`) comes in through the same queue
(:meth:`Door.queue_task`, :meth:`Door.wait_for`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import select

from dmsc.data.db import TaskRecord
from dmsc.runtime.business.queueing import TaskFinished
from dmsc.runtime.control.tasks.task_queue import FINISHED, TaskQueue
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.runtime.transport.rpc import Abandoned

POLL_S = 0.2

# what running a task gave (a training task: its report and model version), or what failed
Ran = object


@dataclass
class _Waiting:
    ran: list[Ran] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)


class Door:
    """Submits resolved training tasks to ``queue``; ``resolve`` is the control plane's check
    (BadRequest says what is wrong)."""

    def __init__(self, queue: TaskQueue, resolve: Callable[[TrainRequest], TrainParams]) -> None:
        self.queue, self.resolve = queue, resolve
        self._waiting: dict[int, _Waiting] = {}
        self._lock = threading.Lock()

    def submit(
        self, req: TrainRequest, tenant: str = "default", max_attempts: int = 3, wait: bool = False
    ) -> tuple[TaskRecord, TrainParams]:
        """Resolve ``req`` and queue it; ``wait``: :meth:`wait` will be asked for its end."""
        params = self.resolve(req)
        args = (tenant, req.priority, req.lane, max_attempts, wait)
        return self.queue_task("train", params.as_json(), *args), params

    def queue_task(
        self,
        kind: str,
        params: dict[str, object],
        tenant: str,
        priority: int,
        lane: str,
        max_attempts: int,
        wait: bool = False,
    ) -> TaskRecord:
        """Queue a task of ``kind`` whose ``params`` are resolved already."""
        task = self.queue.submit(
            kind, params, tenant=tenant, priority=priority, lane=lane, max_attempts=max_attempts
        )
        if wait:
            with self._lock:
                self._waiting[task.id] = _Waiting()
        return task

    def ran(self, task_id: int, outcome: Ran) -> None:
        """What running the task gave (the consumer's run, :meth:`.plane.ControlPlane.run_task`)."""
        with self._lock:
            waiting = self._waiting.get(task_id)
        if waiting is not None:
            waiting.ran.append(outcome)
            waiting.event.set()

    def ended(self, task_id: int) -> bool:
        """Whether the task has reached one of the ends."""
        return self._state(task_id) in FINISHED

    def wait(
        self, task_id: int, gone: threading.Event | None = None
    ) -> tuple[TrainReport, int, str]:
        """The report, model version and end state of the training task once it ended (as
        :meth:`wait_for`)."""
        ran, state = self.wait_for(task_id, gone)
        assert isinstance(ran, tuple)  # what run_task gave: (report, version)
        return ran[0], ran[1], state

    def wait_for(self, task_id: int, gone: threading.Event | None = None) -> tuple[object, str]:
        """What running the task gave and its end state, once it ended; raises what it
        failed with. ``gone`` set (the caller went away) cancels it; a task cancelled before
        it started raises :class:`~dmsc.runtime.transport.rpc.Abandoned`."""
        with self._lock:
            waiting = self._waiting[task_id]
        asked = False
        try:
            while True:
                waiting.event.wait(POLL_S)
                if gone is not None and gone.is_set() and not asked:
                    asked = True
                    with contextlib.suppress(KeyError, TaskFinished):
                        self.queue.cancel(task_id)
                state = self._state(task_id)
                if state not in FINISHED:
                    continue
                if not waiting.ran:
                    raise Abandoned(f"task {task_id} was {state} before it started")
                outcome = waiting.ran[-1]
                if isinstance(outcome, BaseException):
                    raise outcome
                return outcome, state
        finally:
            with self._lock:
                self._waiting.pop(task_id, None)

    def _state(self, task_id: int) -> str | None:
        with self.queue.db.sessions() as s:
            return s.scalar(select(TaskRecord.state).where(TaskRecord.id == task_id))
