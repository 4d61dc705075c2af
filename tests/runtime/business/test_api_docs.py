"""The gateway's API docs read offline (issue 29, point 9): ``/docs`` loaded Swagger UI's script,
style and icon from a CDN, and without a network the page stayed blank. Every file the page
asks for is now served by the gateway itself, and ``/redoc`` (a CDN page too) is gone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dmsc.data.db import Database
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.tasks.task_queue import TaskQueue


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


@pytest.mark.integration
def test_docs_render_in_a_browser_that_reaches_no_other_host(
    tmp_path: Path, chromedriver: str
) -> None:
    """Chromium, with every host but this machine unresolvable, draws the API's title and
    operations and logs no error."""
    import threading
    import time

    import uvicorn
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    db = Database(f"sqlite:///{tmp_path / 'd.sqlite'}")
    app = create_app(Backend(), db, TaskQueue(db, db.new_run("gpt-mini", "c", {}).id))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1")
    options.binary_location = "/usr/bin/chromium"
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    try:
        driver.get(f"http://127.0.0.1:{port}/docs")
        WebDriverWait(driver, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .info .title")
        )
        title = driver.find_element(By.CSS_SELECTOR, ".swagger-ui .info .title").text
        assert "dmsc gateway" in title
        assert len(driver.find_elements(By.CSS_SELECTOR, ".opblock")) >= 5  # the endpoints
        log: Any = driver
        errors = [e["message"] for e in log.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(timeout=10)
