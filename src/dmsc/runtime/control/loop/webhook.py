"""Alerts posted to the policy's webhook, from a thread of their own: the loop never waits on it.

:meth:`Webhook.send` puts an alert on a bounded queue and returns at once (a full queue drops
the alert and says so through ``done``: the loop's tick never blocks on a slow or dead
receiver). One daemon thread posts each alert as JSON with httpx, and retries a failed post (no
connection, a timeout, a 5xx or 429 answer) after a backoff that doubles from ``first_backoff_s``,
``attempts`` times in all; a 4xx other than 429 is the receiver refusing the alert and is not
retried. ``done(alert_id, outcome)`` is told how each ended: ``sent``, or ``failed: <why>``.

The retry loop is written here: httpx retries only failed connections (its transport's
``retries``), never an answer of 5xx, and a retry library is not a dependency for these lines.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

log = logging.getLogger(__name__)

Done = Callable[[int, str], None]


class Webhook:
    """The sender of alerts to one URL (module docstring)."""

    def __init__(
        self,
        url: str,
        done: Done,
        attempts: int = 4,
        first_backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        capacity: int = 100,
    ) -> None:
        self.url, self.done = url, done
        self.attempts, self.first_backoff_s = attempts, first_backoff_s
        self._queue: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue(capacity)
        self._client = httpx.Client(timeout=timeout_s)
        self._thread = threading.Thread(target=self._run, name="alert-webhook", daemon=True)
        self._thread.start()

    def send(self, alert_id: int, body: dict[str, Any]) -> bool:
        """Queue an alert; False (and ``done`` told why) when the queue is full."""
        try:
            self._queue.put_nowait((alert_id, body))
        except queue.Full:
            self.done(alert_id, "failed: the webhook's queue is full")
            return False
        return True

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the thread after the alerts queued (within ``wait_s``), then the client."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(wait_s)
        if not self._thread.is_alive():
            self._client.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            alert_id, body = item
            outcome = self._post(body)
            try:
                self.done(alert_id, outcome)
            except Exception:  # recording the outcome must not stop the sender
                log.exception("recording alert %d's webhook outcome failed", alert_id)

    def _post(self, body: dict[str, Any]) -> str:
        why = ""
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self.first_backoff_s * 2 ** (attempt - 1))
            try:
                reply = self._client.post(self.url, json=body)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
                continue
            if reply.is_success:
                return "sent" + (f" (attempt {attempt + 1})" if attempt else "")
            why = f"HTTP {reply.status_code}"
            if reply.status_code < 500 and reply.status_code != 429:
                return f"failed: {why} (not retried)"
        return f"failed: {why} after {self.attempts} attempts"
