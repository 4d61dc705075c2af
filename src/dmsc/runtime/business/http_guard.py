"""The gateway's outer layer, in plain ASGI: what every request passes before any endpoint.

- **Authentication before the body.** A request that can carry a body (any method but GET,
  HEAD and OPTIONS) must present a valid key before a byte of its body is read: without one it
  is answered 401 and the connection closed, so an anonymous client cannot make the gateway
  buffer or parse anything. The principal found is left in ``scope["state"]["principal"]``
  for the endpoint's scope and rate-limit checks (GET requests are looked up here too, and
  refused there if the endpoint needs a key).
- **Body limits on the stream.** ``Content-Length`` over the limit is 413 at once; a chunked or
  lying body is counted as it arrives and answered 413 the moment it passes the limit.
- **JSON bodies.** Every body the API takes is JSON, so it is read as JSON whatever content
  type the client declared (``curl -d`` declares a form).
- **A read deadline.** The whole body must arrive within ``read_timeout_s``; a client that
  announces 100 bytes and sends 9 gets 408 and its connection closed, rather than holding it.
- **The dashboard's session cookie.** A ``GET`` under ``/ui`` without an ``Authorization``
  header may present the cookie that ``POST /ui/login`` set: it stands for the key given at
  login (looked up again on every request, so a revoked key logs the session out). The cookie is
  honoured for reads of the dashboard only, never for the API or for a request with a body, so
  a page elsewhere cannot make a browser spend it. ``POST /ui/login`` itself is the one request
  with a body that needs no key: its body is a form of at most :data:`LOGIN_BODY_BYTES`.
- **Metrics** labelled by the route's template (never the raw path, which anyone could vary to
  grow ``/metrics`` without bound): requests by status, and latency.

It is plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which costs about half the
throughput of a small endpoint (measured in ``benchmarks/gateway_side_by_side.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from anyio import to_thread
from prometheus_client import Counter, Histogram

from dmsc.data.db import StorageError
from dmsc.runtime.business.auth import PrincipalCache

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BODYLESS = frozenset({"GET", "HEAD", "OPTIONS"})
UNAUTHORIZED = "missing, unknown or revoked API key"
UI_PREFIX = "/ui"
LOGIN_PATH = "/ui/login"
LOGIN_BODY_BYTES = 1024  # a form with one key in it
SESSION_COOKIE = "dmsc_ui"


class SessionStore(Protocol):
    """The dashboard's sessions: a cookie's value -> the Authorization it stands for."""

    def authorization(self, token: str) -> str | None: ...


def cookie(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    """The value of cookie ``name`` in a request's headers, or None."""
    for k, v in headers:
        if k == b"cookie":
            for part in v.decode("latin-1").split(";"):
                key, _, value = part.strip().partition("=")
                if key == name and value:
                    return value
    return None


async def refuse(
    send: Send, status: int, detail: str, headers: dict[str, str] | None = None
) -> None:
    """A JSON error that also closes the connection (its unread body is not worth reading)."""
    body = json.dumps({"detail": detail}).encode()
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The ASGI middleware described above, around the gateway's FastAPI app."""

    def __init__(
        self,
        app: ASGIApp,
        principals: PrincipalCache,
        requests: Counter,
        latency: Histogram,
        max_body_bytes: int = 64 * 1024,
        read_timeout_s: float = 10.0,
        sessions: SessionStore | None = None,
    ) -> None:
        self.app, self.principals, self.sessions = app, principals, sessions
        self.requests, self.latency = requests, latency
        self.max_body_bytes, self.read_timeout_s = max_body_bytes, read_timeout_s
        self._counters: dict[tuple[str, int], Any] = {}
        self._histograms: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_seen)
        finally:
            path = getattr(scope.get("route"), "path", None) or "<unmatched>"
            self._counter(path, status).inc()
            self._histogram(path).observe(time.perf_counter() - t0)

    def _counter(self, path: str, status: int) -> Any:
        """The labelled child, kept: ``labels()`` takes a lock and builds a key every call.
        Bounded: paths are route templates, statuses a few codes."""
        child = self._counters.get((path, status))
        if child is None:
            child = self._counters[(path, status)] = self.requests.labels(path, str(status))
        return child

    def _histogram(self, path: str) -> Any:
        child = self._histograms.get(path)
        if child is None:
            child = self._histograms[path] = self.latency.labels(path)
        return child

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_auth = length = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                raw_auth = v
            elif k == b"content-length":
                length = v
        authorization = raw_auth.decode("latin-1") if raw_auth is not None else None
        path, method = scope.get("path", ""), scope["method"]
        on_ui = path == UI_PREFIX or path.startswith(UI_PREFIX + "/")
        if method == "POST" and path == LOGIN_PATH:  # the one body read without a key
            body = await self._read_body(receive, send, LOGIN_BODY_BYTES)
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
            return
        if authorization is None and on_ui and method in BODYLESS and self.sessions:
            token = cookie(scope["headers"], SESSION_COOKIE)
            authorization = self.sessions.authorization(token) if token else None
        who = self.principals.cached(authorization)  # a known key: no database, no thread
        if who is None and authorization:
            try:  # a database read: off the event loop
                who = await to_thread.run_sync(self.principals.lookup, authorization)
            except StorageError as exc:  # the key store cannot be read: nobody gets in
                await refuse(send, 503, str(exc))
                return
        scope.setdefault("state", {})["principal"] = who
        if scope["method"] in BODYLESS:
            await self.app(scope, receive, send)
            return
        if who is None:
            await refuse(send, 401, UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
            return
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            bad = not length.isdigit()
            await refuse(
                send,
                400 if bad else 413,
                "bad Content-Length" if bad else f"body over {self.max_body_bytes} bytes",
            )
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        # Every body this API takes is JSON: read it as JSON whatever the client declared
        # (``curl -d`` says application/x-www-form-urlencoded, and got 422).
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope["headers"].append((b"content-type", b"application/json"))
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(
        self, receive: Receive, send: Send, limit: int | None = None
    ) -> bytes | None:
        """The whole body (at most ``limit`` bytes, the gateway's limit by default), or None
        once a refusal was sent (or the client left)."""
        limit = self.max_body_bytes if limit is None else limit
        body = bytearray()
        end = time.monotonic() + self.read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, end - time.monotonic()))
            except TimeoutError:
                await refuse(send, 408, f"body not received within {self.read_timeout_s:g} s")
                return None
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                await refuse(send, 413, f"body over {limit} bytes")
                return None
            if not message.get("more_body", False):
                return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body already read, then what the client sends next (a
    disconnect, for endpoints that watch for one)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def header_deadline_protocol(seconds: float) -> type:
    """uvicorn's HTTP protocol (httptools) with a deadline on request headers: a connection
    whose request line and headers are not complete ``seconds`` after it opened (or after its
    previous response) is closed. uvicorn times out idle keep-alive connections but not a
    request that trickles in, so without this a few hundred slow clients hold as many
    connections open for as long as they like (and ``limit_concurrency`` then turns everyone
    else away). Subclassing is the hook uvicorn offers (``Config(http=...)``).

    Its transport joins the writes of one loop turn (:mod:`~dmsc.runtime.business.coalescing`),
    so an answer's headers and body leave in one write, over HTTPS in one TLS record."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from dmsc.runtime.business.coalescing import Coalescing

    class HeaderDeadline(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(Coalescing(transport, self.loop))  # type: ignore[arg-type]
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadline
