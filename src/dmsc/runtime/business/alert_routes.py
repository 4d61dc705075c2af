"""The gateway's ``GET /v1/alerts``: the alerts the control loop raised when an objective of the
policy broke (:mod:`dmsc.data.control_records`), newest first.

Any key with the ``read`` scope may read them: an objective is the deployment's, not a tenant's.
An alert's task (the one at fault, and the exception raised for it) is shown to its own tenant
and to an admin key only, as ``/v1/exceptions`` shows a task. ``?open=true`` keeps the alerts
not resolved yet; ``?limit=N`` the newest N (at most 1000).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request

from dmsc.data.control_records import alert_json, alerts
from dmsc.data.db import Database, TaskRecord
from dmsc.runtime.business.auth import Principal


def mount_alerts(
    app: FastAPI, db: Database, authorize: Callable[[Request, str], Principal]
) -> None:
    """``GET /v1/alerts`` on ``app``, authorized by ``authorize`` (key, scope, rate)."""

    @app.get("/v1/alerts")
    def list_alerts(
        request: Request,
        open: Annotated[bool, Query(description="only the alerts not resolved yet")] = False,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        who = authorize(request, "read")
        rows = [alert_json(a) for a in alerts(db, open_only=open, limit=limit)]
        if who.may("admin"):
            return rows
        tasks = {r["task"] for r in rows if r["task"] is not None}
        own = set()
        if tasks:
            with db.sessions() as s:
                for t in tasks:
                    rec = s.get(TaskRecord, t)
                    if rec is not None and rec.tenant == who.tenant:
                        own.add(t)
        hidden = {"task": None, "exception_task": None}
        return [r if r["task"] in own else {**r, **hidden} for r in rows]
