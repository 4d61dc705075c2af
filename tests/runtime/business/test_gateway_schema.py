"""Schemathesis against the gateway's own OpenAPI schema: no request it generates gets a 5xx."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings

from dmsc.data.db import Database
from dmsc.runtime.business.auth import create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.tasks.task_queue import TaskQueue
from dmsc.runtime.transport.messages import Sampling


class Backend:
    def replicas(self) -> list[str]:
        return ["replica-0", "replica-1"]

    def infer_on(
        self,
        replica: str,
        prompt: str,
        tokens: int,
        cancel: threading.Event | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        sampling: Sampling | None = None,
    ) -> str:
        return prompt[:tokens]

    def services(self) -> list[dict[str, str]]:
        return [{"sid": r} for r in self.replicas()]

    def stage_count(self) -> int:
        return 2


_db = Database(f"sqlite:///{Path(tempfile.mkdtemp()) / 'schema.sqlite'}")
_run = _db.new_run("gpt-mini", "local", {})
APP = create_app(Backend(), _db, TaskQueue(_db, _run.id), rate=1e9, burst=1e9)
KEY = create_key(_db, "fuzz", ["admin"])[1]
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    for headers in ({"Authorization": f"Bearer {KEY}"}, {}):
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.path, response.status_code)
