"""The dashboard keeps tenants apart (issue 29, items 10 and 17): a tenant's read key (or its
login cookie) sees its own tasks, errors, metrics and traffic on ``/ui/api/state``, as
``GET /v1/tasks`` shows them, never another tenant's; an admin key sees every tenant's. And the
login form takes no cross-site POST."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dmsc.data.db import Database, ModelVersionRecord, TaskRecord
from dmsc.data.traces import add_step_traces
from dmsc.planner.solve import plan_job
from dmsc.runtime.business.auth import PrincipalCache, create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.business.http_guard import SESSION_COOKIE
from dmsc.runtime.control.dashboard_state import tenant_rows
from dmsc.runtime.control.tasks.task_queue import TaskQueue
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]


class Backend:
    def replicas(self) -> list[str]:
        return ["replica-0"]

    def infer_on(self, replica: str, prompt: str, tokens: int, *args: Any, **kw: Any) -> str:
        return "x" * tokens

    def services(self) -> list[dict[str, Any]]:
        return []

    def stage_count(self) -> int:
        return 1


@pytest.fixture
def site(tmp_path: Path):  # type: ignore[no-untyped-def]
    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/two-sites-cpu.yaml")
    job = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    db = Database(f"sqlite:///{tmp_path / 'g.sqlite'}")
    run = db.new_run("gpt-mini", "two-sites-cpu", {})
    tasks = {}
    for tenant, error in (("alpha", "alpha's secret failure"), ("beta", "beta's secret failure")):
        t = db.add(
            TaskRecord(run_id=run.id, kind="train", params_json="{}", state="failed", tenant=tenant)
        )
        db.set_task_state(t.id, "failed", error)
        db.add_metric(t.id, 0, 4.0 if tenant == "alpha" else 9.0, 0.5, 100.0)
        add_step_traces(db, t.id, 0, {(0, 0): ([("F", 0, 1.0, 1.1)], {"1/0": 123})}, {})
        tasks[tenant] = t.id
    db.add(
        ModelVersionRecord(run_id=run.id, step=5, path="/x", sha256="a" * 64, task_id=tasks["beta"])
    )

    def state(tenant: str | None) -> dict[str, Any]:
        return {"run": run.id, **tenant_rows(db, plan, run.id, tenant)}

    app = create_app(
        Backend(),
        db,
        TaskQueue(db, run.id),
        principals=PrincipalCache(db, ttl_s=0.0),
        dashboard=state,
        rate=1000,
        burst=1000,
    )
    keys = {
        "alpha": create_key(db, "alpha", ["read"])[1],
        "beta": create_key(db, "beta", ["read"])[1],
        "admin": create_key(db, "ops", ["admin"])[1],
    }
    return TestClient(app, base_url="http://127.0.0.1"), keys, tasks


def _state(client: TestClient, key: str) -> dict[str, Any]:
    r = client.get("/ui/api/state", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_tenant_sees_only_its_own_rows_on_the_dashboard(site) -> None:  # type: ignore[no-untyped-def]
    client, keys, tasks = site
    alpha = _state(client, keys["alpha"])
    text = json.dumps(alpha)
    assert "beta" not in text, text  # neither its tasks, errors nor its tenant name
    assert [t["id"] for t in alpha["tasks"]] == [tasks["alpha"]]
    assert alpha["tasks"][0]["error"] == "alpha's secret failure"
    assert alpha["training"]["task"] == tasks["alpha"] and alpha["training"]["loss"] == [4.0]
    # the model version beta's task made serves everyone, but whose task made it is not shown
    assert [v["task"] for v in alpha["versions"]] == [None]
    # /v1/tasks/N agrees: another tenant's task does not exist for alpha
    h = {"Authorization": f"Bearer {keys['alpha']}"}
    assert client.get(f"/v1/tasks/{tasks['beta']}", headers=h).status_code == 404
    beta = _state(client, keys["beta"])
    assert [t["id"] for t in beta["tasks"]] == [tasks["beta"]]
    assert beta["training"]["loss"] == [9.0] and beta["versions"][0]["task"] == tasks["beta"]
    # an admin key sees every tenant's
    admin = _state(client, keys["admin"])
    assert {t["tenant"] for t in admin["tasks"]} == {"alpha", "beta"}


def test_the_model_list_shows_a_version_s_task_to_its_own_tenant_only(site) -> None:  # type: ignore[no-untyped-def]
    """GET /v1/models listed every version with the task that trained it to every tenant's
    read key, the task id the dashboard and /v1/tasks/N hide from another tenant."""
    client, keys, tasks = site

    def listed(key: str) -> list[int | None]:
        r = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return [v["task"] for v in r.json()]

    assert listed(keys["alpha"]) == [None]
    assert listed(keys["beta"]) == [tasks["beta"]]
    assert listed(keys["admin"]) == [tasks["beta"]]


def test_a_tenant_s_login_cookie_sees_only_its_own_rows(site) -> None:  # type: ignore[no-untyped-def]
    client, keys, tasks = site
    r = client.post("/ui/login", data={"key": keys["alpha"]}, follow_redirects=False)
    assert r.status_code == 303
    assert client.cookies.get(SESSION_COOKIE)
    r = client.get("/ui/api/state")
    assert r.status_code == 200 and "beta" not in r.text
    assert [t["id"] for t in r.json()["tasks"]] == [tasks["alpha"]]


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://127.0.0.1:9999"},  # another port is another origin
    ],
)
def test_a_cross_site_login_post_is_refused(site, headers: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    client, keys, _ = site
    r = client.post(
        "/ui/login", data={"key": keys["alpha"]}, headers=headers, follow_redirects=False
    )
    assert r.status_code == 403 and "another site" in r.text
    assert SESSION_COOKIE not in r.headers.get("set-cookie", "")
    # the same form from the dashboard's own page logs in, with its origin or, as Chromium sends
    # it under the pages' Referrer-Policy: no-referrer, "null" marked same-origin
    for own in (
        {"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"},
        {"Origin": "null", "Sec-Fetch-Site": "same-origin"},
    ):
        r = client.post(
            "/ui/login", data={"key": keys["alpha"]}, headers=own, follow_redirects=False
        )
        assert r.status_code == 303 and SESSION_COOKIE in r.headers["set-cookie"]
