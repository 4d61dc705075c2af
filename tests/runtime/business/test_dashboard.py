"""The dashboard's pages over HTTP (FastAPI's TestClient, a real database and real keys): who
gets in (a Bearer key with read scope, or the login form's cookie, for dashboard reads only),
what the pages and the state endpoint answer, and what is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dmsc.data.db import Database
from dmsc.runtime.business.auth import PrincipalCache, create_key, revoke
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.business.http_guard import SESSION_COOKIE
from dmsc.runtime.control.tasks.task_queue import TaskQueue

STATE = {"run": 1, "services": [{"sid": "s0-r0", "health": "ok"}]}


class Backend:
    """One replica that answers every request with x's."""

    def replicas(self) -> list[str]:
        return ["replica-0"]

    def infer_on(self, replica: str, prompt: str, tokens: int, *args: Any, **kw: Any) -> str:
        return "x" * tokens

    def services(self) -> list[dict[str, Any]]:
        return [{"sid": "s0-r0"}]

    def stage_count(self) -> int:
        return 1


@pytest.fixture(params=["http", "https"])
def ui(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The app with a dashboard and its client, by plain HTTP or HTTPS (the scheme is what the
    session cookie's Secure flag follows)."""
    db = Database(f"sqlite:///{tmp_path / 'g.sqlite'}")
    run = db.new_run("gpt-mini", "local", {})
    calls: list[int] = []

    def state(tenant: str | None) -> dict[str, Any]:
        calls.append(1)
        return STATE

    principals = PrincipalCache(db, ttl_s=0.0)
    app = create_app(
        Backend(),
        db,
        TaskQueue(db, run.id),
        principals=principals,
        dashboard=state,
        rate=1000,
        burst=1000,
    )
    keys = {
        "reader": create_key(db, "ops", ["read"]),
        "infer": create_key(db, "app", ["infer"]),
        "admin": create_key(db, "ops", ["read", "infer", "submit"]),
    }
    return TestClient(app, base_url=f"{request.param}://127.0.0.1"), db, keys, principals, calls


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_without_a_key_every_page_is_the_login_form_with_401(ui) -> None:  # type: ignore[no-untyped-def]
    client, *_ = ui
    for path in ("/ui", "/ui/tasks", "/ui/charts"):
        r = client.get(path)
        assert r.status_code == 401 and 'name="key"' in r.text
        assert r.headers["www-authenticate"] == "Bearer"
        assert "default-src 'self'" in r.headers["content-security-policy"]
    assert client.get("/ui/api/state").status_code == 401
    assert client.get("/ui/api/state", headers=_bearer("dmsc_nope")).status_code == 401


def test_a_read_key_opens_the_pages_and_the_state(ui) -> None:  # type: ignore[no-untyped-def]
    client, _, keys, _, calls = ui
    for path, page in (("/ui", "overview"), ("/ui/tasks", "tasks"), ("/ui/charts", "charts")):
        r = client.get(path, headers=_bearer(keys["reader"][1]))
        assert r.status_code == 200 and f'data-page="{page}"' in r.text
    r = client.get("/ui/api/state", headers=_bearer(keys["reader"][1]))
    assert r.status_code == 200 and r.json() == STATE
    client.get("/ui/api/state", headers=_bearer(keys["reader"][1]))
    assert len(calls) == 1  # two polls within a second share one build of the state
    r = client.get("/ui/api/state", headers=_bearer(keys["infer"][1]))
    assert r.status_code == 403 and "read" in r.json()["detail"]
    assert client.get("/ui/nope", headers=_bearer(keys["reader"][1])).status_code == 404


def test_the_login_form_sets_a_session_cookie_for_dashboard_reads_only(ui) -> None:  # type: ignore[no-untyped-def]
    client, db, keys, principals, _ = ui
    r = client.post("/ui/login", data={"key": keys["admin"][1]}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert ("Secure" in cookie) == (client.base_url.scheme == "https")  # HTTPS only, when on
    assert keys["admin"][1] not in cookie  # a random token stands for the key
    assert client.get("/ui/api/state").status_code == 200
    assert client.get("/ui").status_code == 200
    # the cookie is no key to the API, neither to read nor to spend (a page elsewhere could
    # make the browser send it)
    token = client.cookies.get(SESSION_COOKIE)
    assert token
    jar = {"Cookie": f"{SESSION_COOKIE}={token}"}
    assert client.get("/v1/tasks", headers=jar).status_code == 401
    assert client.post("/v1/infer", json={"prompt": "x"}, headers=jar).status_code == 401
    # revoking the key ends the session
    revoke(db, keys["admin"][0], principals)
    assert client.get("/ui/api/state").status_code == 401


def test_a_bad_login_says_why_and_logins_are_rate_limited(ui) -> None:  # type: ignore[no-untyped-def]
    client, _, keys, *_ = ui
    r = client.post("/ui/login", data={"key": "dmsc_wrong"})
    assert r.status_code == 401 and "unknown or revoked key" in r.text
    assert SESSION_COOKIE not in r.headers.get("set-cookie", "")
    r = client.post("/ui/login", data={"key": keys["infer"][1]})
    assert r.status_code == 403 and "read" in r.text
    statuses = [client.post("/ui/login", data={"key": "x"}).status_code for _ in range(6)]
    assert 429 in statuses
    r = client.post("/ui/login", content=b"key=" + b"a" * 2000)
    assert r.status_code == 413


def test_logout_ends_the_session(ui) -> None:  # type: ignore[no-untyped-def]
    client, _, keys, *_ = ui
    client.post("/ui/login", data={"key": keys["reader"][1]})
    assert client.get("/ui/api/state").status_code == 200
    r = client.get("/ui/logout")
    assert r.status_code == 401 and "logged out" in r.text
    client.cookies.clear()
    assert client.get("/ui/api/state").status_code == 401


def test_only_the_pages_own_files_are_served(ui) -> None:  # type: ignore[no-untyped-def]
    client, *_ = ui
    r = client.get("/ui/static/dashboard.js")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/static/vendor/chart.umd.min.js").text.startswith("/*!\n * Chart.js v4")
    for name in ("login.html", "../gateway.py", "vendor/chart.js.LICENSE.md", "%2e%2e/auth.py"):
        assert client.get(f"/ui/static/{name}").status_code == 404, name


def test_without_a_dashboard_there_are_no_pages(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'g.sqlite'}")
    run = db.new_run("gpt-mini", "local", {})
    client = TestClient(create_app(Backend(), db, TaskQueue(db, run.id)))
    assert client.get("/ui").status_code == 404
