from __future__ import annotations

import io
import json
import logging

import httpx
from prometheus_client import CollectorRegistry, Counter

from dmsc.runtime.transport.observe import JsonFormatter, metrics_server


def test_json_log_lines_carry_context() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("dmsc.test.observe")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.info("step %d done", 7, extra={"sid": "sid-1-abc", "task_id": 42})
    record = json.loads(stream.getvalue())
    assert record["msg"] == "step 7 done" and record["sid"] == "sid-1-abc"
    assert record["task_id"] == 42 and record["level"] == "info" and record["ts"].endswith("Z")


def test_metrics_server_serves_the_registry() -> None:
    reg = CollectorRegistry()
    Counter("dmsc_test_things_total", "Things", registry=reg).inc(3)
    address = metrics_server(reg)
    text = httpx.get(f"http://{address}/metrics").text
    assert "dmsc_test_things_total 3.0" in text
