"""The gateway's task routes: ``POST /v1/tasks`` (a training task, the request ``dmsc train``
sends), ``POST /v1/tasks/infer`` (a batch of inference requests, what ``dmsc infer --batch``
sends), the tenant's tasks (list, show, cancel), requeue and the exception queue. Both posts go
through the backend's one way in when it has one (the control plane's), so they are checked and
refused in the words of the control plane's own calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam

from dmsc.data.db import Database, TaskRecord
from dmsc.runtime.business.auth import Principal
from dmsc.runtime.business.queueing import QuotaExceeded, TaskFinished, TaskQueue
from dmsc.runtime.transport.messages import InferBatch, TrainRequest

TaskId = Annotated[int, PathParam(ge=1, le=2**62, description="Task id")]


def _task_json(t: TaskRecord) -> dict[str, Any]:
    out = _task_row(t)
    if t.kind == "infer" and t.result_json:  # a batch's answers so far
        out["result"] = json.loads(t.result_json)
    return out


def _task_row(t: TaskRecord) -> dict[str, Any]:
    return {
        "id": t.id,
        "kind": t.kind,
        "state": t.state,
        "tenant": t.tenant,
        "priority": t.priority,
        "attempts": t.attempts,
        "error": t.error,
        "exception_type": t.exception_type,
    }


def mount_tasks(
    app: FastAPI,
    backend: object,
    db: Database,
    queue: TaskQueue,
    authorize: Callable[[Request, str], Principal],
) -> None:
    """The task routes on ``app``, each authorized by ``authorize`` (key, scope, rate)."""

    @app.post("/v1/tasks", status_code=202)
    def submit(req: TrainRequest, request: Request) -> dict[str, Any]:
        """The request ``dmsc train`` sends: resolved and queued by the backend's one way in
        (the control plane's :meth:`~dmsc.runtime.control.plane.ControlPlane.submit_task`);
        a backend without one (a test's) queues it as it came."""
        who = authorize(request, "submit")
        try:
            if (submit_task := getattr(backend, "submit_task", None)) is not None:
                task = submit_task(req, who.tenant)
            else:
                params = req.model_dump(exclude={"priority", "lane"}, exclude_none=True)
                task = queue.submit(
                    "train", params, tenant=who.tenant, priority=req.priority, lane=req.lane
                )
        except QuotaExceeded as exc:  # queued work, not a rate: retrying soon will not help
            raise HTTPException(429, str(exc), headers={"Retry-After": "60"}) from None
        except ValueError as exc:  # the control plane's check (BadRequest): the same words
            raise HTTPException(422, str(exc)) from None
        return _task_json(task)

    @app.post("/v1/tasks/infer", status_code=202)
    def submit_batch(req: InferBatch, request: Request) -> dict[str, Any]:
        """The batch ``dmsc infer --batch`` sends: checked and queued as one ``infer`` task by
        the backend's batches (:mod:`dmsc.runtime.control.tasks.infer_batch`); its answers are
        the task's result (``GET /v1/tasks/ID``)."""
        who = authorize(request, "submit")
        batches = getattr(backend, "batches", None)
        if batches is None:
            raise HTTPException(422, "this gateway's backend runs no inference batches")
        try:
            task = batches.submit(req, who.tenant)
        except QuotaExceeded as exc:
            raise HTTPException(429, str(exc), headers={"Retry-After": "60"}) from None
        except ValueError as exc:  # the control plane's check (BadRequest): the same words
            raise HTTPException(422, str(exc)) from None
        return _task_json(task)

    def _own_task(task_id: int, who: Principal) -> TaskRecord:
        with db.sessions() as s:
            task = s.get(TaskRecord, task_id)
        if task is None or (task.tenant != who.tenant and not who.may("admin")):
            raise HTTPException(404, f"no task {task_id}")
        return task

    @app.get("/v1/tasks")
    def list_tasks(
        request: Request,
        state: Annotated[str | None, Query(max_length=32)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        """The caller's tenant's newest tasks, newest first (an admin key: every tenant's)."""
        who = authorize(request, "read")
        tenant = None if who.may("admin") else who.tenant
        return [_task_json(t) for t in db.recent_tasks(tenant, state, limit)]

    @app.get("/v1/tasks/{task_id}")
    def get_task(task_id: TaskId, request: Request) -> dict[str, Any]:
        return _task_json(_own_task(task_id, authorize(request, "read")))

    @app.delete("/v1/tasks/{task_id}")
    def cancel(task_id: TaskId, request: Request) -> dict[str, Any]:
        """A queued task is cancelled at once; a running one is asked to stop (``cancelling``:
        it stops between two steps, keeps what it trained, and ends ``cancelled``)."""
        _own_task(task_id, authorize(request, "submit"))
        try:
            state = queue.cancel(task_id)
        except KeyError:
            raise HTTPException(404, f"no task {task_id}") from None
        except TaskFinished as exc:
            raise HTTPException(409, str(exc)) from None
        return {"id": task_id, "state": state}

    @app.post("/v1/tasks/{task_id}/requeue")
    def requeue(task_id: TaskId, request: Request) -> dict[str, Any]:
        authorize(request, "admin")
        try:
            queue.requeue(task_id)
        except KeyError as exc:
            raise HTTPException(409, str(exc).strip("'")) from None
        return {"id": task_id, "state": "queued"}

    @app.get("/v1/exceptions")
    def exceptions(request: Request) -> list[dict[str, Any]]:
        who = authorize(request, "read")
        return [
            {**_task_json(t), "log_excerpt": t.log_excerpt}
            for t in queue.exceptions()
            if t.tenant == who.tenant or who.may("admin")
        ]
