"""An HTTPS server for the gateway tests: uvicorn with a self-signed certificate on 127.0.0.1,
started once per module, serving whichever app the test at hand made (:class:`Swap`); and an
``httpx`` client of it that trusts that certificate alone."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from dmsc.runtime.business.https import uvicorn_tls
from dmsc.runtime.transport.authority import self_signed


class Swap:
    """An ASGI app that passes each request to ``app`` (set by each test)."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


@contextmanager
def https_server(folder: Path) -> Iterator[tuple[Swap, str, ssl.SSLContext]]:
    """The app holder, the base URL and a client TLS context, as ``dmsc up --tls`` serves."""
    cert_pem, key_pem = self_signed(["127.0.0.1", "localhost"])
    cert, key = folder / "gateway.pem", folder / "gateway.key"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    swap = Swap()
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    tls = uvicorn_tls(str(cert), str(key))
    server = uvicorn.Server(uvicorn.Config(swap, log_level="warning", lifespan="off", **tls))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the HTTPS server did not start"
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        yield swap, f"https://127.0.0.1:{port}", trust
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def https_client(holder: tuple[Swap, str, ssl.SSLContext], app: Any) -> httpx.Client:
    """A client of ``app`` over HTTPS (``.app`` set, as a TestClient has it)."""
    swap, base, trust = holder
    swap.app = app
    client = httpx.Client(base_url=base, verify=trust, timeout=30)
    client.app = app  # type: ignore[attr-defined]
    return client
