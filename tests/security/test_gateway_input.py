"""Hostile input at the gateway (issue 11, items 7 and 8): values the error handler must still
render, and request paths that must not become metric labels."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dmsc.data.db import Database
from dmsc.runtime.business.auth import create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.tasks.task_queue import TaskQueue
from dmsc.runtime.transport.messages import Sampling


class Backend:
    def replicas(self) -> list[str]:
        return ["replica-0"]

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
        return "x" * tokens

    def services(self) -> list[dict[str, Any]]:
        return []

    def stage_count(self) -> int:
        return 2


@pytest.fixture
def client(tmp_path: Path) -> tuple[TestClient, dict[str, str]]:
    db = Database(f"sqlite:///{tmp_path / 'g.sqlite'}")
    run = db.new_run("gpt-mini", "local", {})
    app = create_app(Backend(), db, TaskQueue(db, run.id), rate=1000, burst=1000)
    _, key = create_key(db, "mallory", ["infer", "submit", "read"])
    return TestClient(app, raise_server_exceptions=False), {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "body",
    [
        '{"prompt": "x", "tokens": NaN}',
        '{"prompt": "x", "tokens": Infinity}',
        '{"prompt": "\\ud800", "tokens": 0}',  # a lone surrogate beside a bad field
        '{"prompt": "x", "tokens": 1, "\\udfff": 1}',
        '{"steps": NaN}',
    ],
)
def test_unrenderable_values_get_a_422_not_a_500(
    client: tuple[TestClient, dict[str, str]], body: str
) -> None:
    c, auth = client
    path = "/v1/tasks" if "steps" in body else "/v1/infer"
    r = c.post(path, content=body, headers={**auth, "content-type": "application/json"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail and all("loc" in d and "msg" in d for d in detail)


def test_unknown_paths_do_not_grow_the_metrics(
    client: tuple[TestClient, dict[str, str]],
) -> None:
    c, _ = client
    for i in range(200):
        assert c.get(f"/probe/{i}/{'a' * 50}").status_code == 404
    text = c.get("/metrics").text
    assert "/probe/" not in text
    assert 'endpoint="<unmatched>"' in text
    before = len(c.get("/metrics").text)  # now /metrics has its own series too
    for i in range(200, 400):
        c.get(f"/probe/{i}")
    assert len(c.get("/metrics").text) - before < 200  # counts change, no new series
