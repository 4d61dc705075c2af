"""The gateway's protocol sends an answer in one write: over HTTPS, one TLS record, read off the
wire by a client of Python's own TLS; and the transport wrapper keeps the real one's order."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from dmsc.runtime.business.coalescing import Coalescing
from dmsc.runtime.business.http_guard import header_deadline_protocol
from dmsc.runtime.transport.authority import self_signed


class Recording:
    """A transport that records its writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_the_writes_of_one_turn_leave_as_one_in_order() -> None:
    async def run() -> Recording:
        real = Recording()
        t = Coalescing(real, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.writelines([b"{", b"}"])
        assert real.writes == [] and t.get_write_buffer_size() == 21
        await asyncio.sleep(0)  # the loop's next turn
        t.write(b"next")
        t.close()  # sends what is kept before closing
        t.write(b"after close")
        await asyncio.sleep(0)
        assert t.get_extra_info("peername") == "info:peername"
        return real

    real = asyncio.run(run())
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}", b"next"]
    assert real.closed


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[int]:
    cert, key = self_signed(["127.0.0.1"])
    (tmp_path / "c.pem").write_bytes(cert)
    (tmp_path / "k.pem").write_bytes(key)
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"ok": "yes"}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="error",
            ssl_certfile=str(tmp_path / "c.pem"),
            ssl_keyfile=str(tmp_path / "k.pem"),
            http=header_deadline_protocol(5.0),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        threading.Event().wait(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def _records_with_data(port: int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` over TLS; how many of the server's TLS records carried answer bytes
    (session tickets carry none), and the answer."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        while True:  # the handshake over the real socket
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536))
        sock.sendall(outgoing.read())
        tls.write(request)
        sock.sendall(outgoing.read())
        wire, answer, records = b"", b"", 0
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            wire += sock.recv(65536)
            while len(wire) >= 5 and len(wire) >= 5 + int.from_bytes(wire[3:5], "big"):
                n = 5 + int.from_bytes(wire[3:5], "big")  # one whole record
                incoming.write(wire[:n])
                wire = wire[n:]
                try:
                    got = tls.read(65536)
                except ssl.SSLWantReadError:
                    continue  # a record with no answer bytes (a session ticket)
                records += 1
                answer += got
    return records, answer


def test_an_answer_over_https_is_one_tls_record(https_server: int) -> None:
    request = b"GET /ping HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    records, answer = _records_with_data(https_server, request)
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'{"ok":"yes"}')
    assert records == 1  # uvicorn alone sends the headers and the body as two records
