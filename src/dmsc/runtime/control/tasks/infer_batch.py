"""A batch of inference requests as one queued task (kind ``infer``): ``dmsc infer --batch``'s
``InferBatch`` call and the gateway's ``POST /v1/tasks/infer`` hand the same
:class:`~dmsc.runtime.transport.messages.InferBatch` to :meth:`Batches.submit`, which checks every
request as the ``Infer`` call would (a request the control plane cannot serve refuses the whole
batch, naming it: ``requests.3.aggregate: ...``) and queues it through the one way in
(:class:`.door.Door`). A consumer of the queue runs it (:meth:`Batches.run`): the requests in
order, each answer (or why a request got none) stored with the task as its result
(``{"answers": [...]}``), a cancel stopping it at the next token. The call waits for its end;
its caller going away cancels it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from dmsc.data.db import Database, TaskRecord
from dmsc.runtime.control.tasks.door import Door
from dmsc.runtime.control.tasks.task_queue import TaskQueue, cancel_requested
from dmsc.runtime.transport.messages import InferBatch, InferRequest
from dmsc.runtime.transport.rpc import BadRequest, parse

POLL_S = 0.2  # how often a running batch looks for a cancel request


class Answers(Protocol):
    """The control plane's inference (:class:`~..serving.infer_calls.InferCalls`)."""

    def check(self, req: InferRequest) -> None: ...
    def answer(
        self, req: InferRequest, cancel: threading.Event | None = None
    ) -> dict[str, Any]: ...


class Drives(Protocol):
    """The queue's consumers (:class:`.work_loop.Consumers`)."""

    def drive(self, queue: TaskQueue, lane: str, until: Callable[[], bool]) -> None: ...


class Batches:
    """Inference batches of one control plane, queued through ``door``."""

    def __init__(
        self, door: Door, calls: Answers, consumers: Drives, stopped: threading.Event
    ) -> None:
        self.door, self.calls, self.consumers, self.stopped = door, calls, consumers, stopped

    @property
    def db(self) -> Database:
        return self.door.queue.db

    def submit(
        self, req: InferBatch, tenant: str = "default", max_attempts: int = 3, wait: bool = False
    ) -> TaskRecord:
        """Check every request and queue the batch (BadRequest names the request and field)."""
        for i, one in enumerate(req.requests):
            try:
                self.calls.check(one)
            except BadRequest as exc:
                raise BadRequest(f"requests.{i}.{exc}") from None
        params: dict[str, object] = {
            "requests": [r.model_dump(mode="json", exclude_defaults=True) for r in req.requests]
        }
        args = (tenant, req.priority, req.lane, max_attempts, wait)
        return self.door.queue_task("infer", params, *args)

    def call(self, req: InferBatch, gone: threading.Event | None = None) -> dict[str, Any]:
        """The ``InferBatch`` call: queued, then waited for until it ends (one attempt: the
        caller sees a failure as the task does); ``gone`` set cancels it."""
        task = self.submit(req, max_attempts=1, wait=True)
        ended = lambda: self.door.ended(task.id)  # noqa: E731 - no consumer runs: this thread works
        self.consumers.drive(self.door.queue, req.lane, ended)
        answers, state = self.door.wait_for(task.id, gone)
        return {"task": task.id, "state": state, "answers": answers}

    def run(self, task_id: int, params: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """Run a queued batch (a consumer's work): its answers, stored with the task, and
        whether a cancel stopped it; told to a caller that waits."""
        try:
            ran = self._run(task_id, params)
        except BaseException as exc:
            self.door.ran(task_id, exc)
            raise
        self.door.ran(task_id, ran[0])
        return ran

    def _run(self, task_id: int, params: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        requests = [parse(InferRequest, r) for r in params["requests"]]
        cancel, done = threading.Event(), threading.Event()

        def watch() -> None:  # a cancel request stops the running request at its next token
            while not done.wait(POLL_S):
                if cancel_requested(self.db, task_id) or self.stopped.is_set():
                    cancel.set()
                    return

        watcher = threading.Thread(target=watch, name=f"batch-{task_id}", daemon=True)
        watcher.start()
        answers: list[dict[str, Any]] = []
        try:
            for req in requests:
                if cancel.is_set():
                    break
                try:
                    got = self.calls.answer(req, cancel)
                except Exception as exc:  # this request's failure: the next ones still run
                    if cancel.is_set():
                        break
                    answers.append({"error": f"{type(exc).__name__}: {exc}"})
                else:
                    answers.append({k: v for k, v in got.items() if v is not None})
                self.db.set_task_result(task_id, {"answers": answers})
        finally:
            done.set()
            watcher.join()
        self.db.set_task_result(task_id, {"answers": answers})
        return answers, cancel_requested(self.db, task_id)
