"""Observability: Prometheus metrics servers and structured JSON logs (with task ID and SID)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


def metrics_server(registry: CollectorRegistry) -> str:
    """Serve ``registry`` at http://127.0.0.1:PORT/metrics on a free port; returns HOST:PORT."""
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    return f"127.0.0.1:{server.server_port}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` context."""

    CONTEXT = ("sid", "task_id", "stage", "replica", "step", "run")

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in self.CONTEXT:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def json_logger(name: str, level: int = logging.INFO) -> logging.Logger:
    """A logger writing JSON lines to stderr (where the launcher keeps each worker's log)."""
    log = logging.getLogger(name)
    if not any(isinstance(h.formatter, JsonFormatter) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False
    return log
