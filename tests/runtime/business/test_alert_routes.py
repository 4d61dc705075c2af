"""``GET /v1/alerts``: the control loop's alerts, newest first, to any key with ``read``; the task
at fault shown to its own tenant and to admin keys only; ``?open=true`` and ``?limit``."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from types import SimpleNamespace

from fastapi.testclient import TestClient

from dmsc.data.control_records import add_alert
from dmsc.data.db import Database
from dmsc.runtime.business.auth import PrincipalCache, create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.tasks.task_queue import TaskQueue


def test_alerts_newest_first_with_the_task_shown_to_its_tenant(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'g.sqlite'}")
    run = db.new_run("gpt-mini", "local", {}).id
    task = db.new_task(run, "train", {}, state="running")
    with db.sessions() as s, s.begin():
        s.merge(task).tenant = "alice"
    fields = {"value": 2.0, "objective": 1.0, "reason": "slow"}
    first = add_alert(db, run, slo="step_time_s", task_id=task.id, exception_task=9, **fields)
    second = add_alert(db, run, slo="error_rate", resolved_at=dt.datetime.now(dt.UTC), **fields)
    backend = SimpleNamespace(stage_count=lambda: 1)  # no route here calls it again
    app = create_app(backend, db, TaskQueue(db, run), principals=PrincipalCache(db))
    client = TestClient(app)
    keys = {
        name: create_key(db, tenant, scopes)[1]
        for name, tenant, scopes in [
            ("alice", "alice", ["read"]),
            ("bob", "bob", ["read"]),
            ("admin", "ops", ["admin"]),
            ("infer", "bob", ["infer"]),
        ]
    }

    def get(key: str, query: str = "") -> list[dict[str, object]]:
        r = client.get(f"/v1/alerts{query}", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    assert client.get("/v1/alerts").status_code == 401
    assert (
        client.get("/v1/alerts", headers={"Authorization": f"Bearer {keys['infer']}"}).status_code
        == 403
    )
    rows = get(keys["alice"])
    assert [r["id"] for r in rows] == [second, first]
    assert (rows[1]["task"], rows[1]["exception_task"], rows[1]["slo"]) == (
        task.id,
        9,
        "step_time_s",
    )
    assert [(r["task"], r["exception_task"]) for r in get(keys["bob"])] == [(None, None)] * 2
    assert get(keys["admin"])[1]["task"] == task.id
    assert [r["id"] for r in get(keys["bob"], "?open=true")] == [first]
    assert [r["id"] for r in get(keys["bob"], "?limit=1")] == [second]
    assert (
        client.get(
            "/v1/alerts?limit=0", headers={"Authorization": f"Bearer {keys['bob']}"}
        ).status_code
        == 422
    )
