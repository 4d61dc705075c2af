"""The gateway's API docs read offline (issue 29, point 9): ``/docs`` loaded Swagger UI's script,
style and icon from a CDN, and without a network the page stayed blank. Every file the page
asks for is now served by the gateway itself, and ``/redoc`` (a CDN page too) is gone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from dmsc.data.db import Database
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.task_queue import TaskQueue


class Backend:
    """No replica answers: the docs need none."""

    def stage_count(self) -> int:
        return 1

    def replicas(self) -> list[str]:
        return []

    def services(self) -> list[dict[str, Any]]:
        return []

    def infer_on(self, replica: str, prompt: str, tokens: int, *args: Any, **kw: Any) -> str:
        raise ConnectionError(f"{replica}: no replica in this test")


def test_docs_need_nothing_from_outside(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")
    run = db.new_run("gpt-mini", "c", {})
    client = TestClient(create_app(Backend(), db, TaskQueue(db, run.id)))
    page = client.get("/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", page.text)
    assert {u.rsplit(".", 1)[-1] for u in urls} >= {"js", "css", "json"}
    for url in urls:
        assert not re.match(r"^(https?:)?//", url), f"{url}: fetched from outside"
        got = client.get(url)
        assert got.status_code == 200 and len(got.content) > 0, url
    script = client.get(next(u for u in urls if u.endswith(".js")))
    assert script.headers["content-type"].startswith("text/javascript")
    assert "SwaggerUIBundle" in script.text
    assert client.get("/docs/nothing.js").status_code == 404
    assert client.get("/redoc").status_code == 404
