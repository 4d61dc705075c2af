"""A chained inference step's ``Relay`` (:mod:`.relay`) to the next stage of one datacenter over
a TCP connection kept open, rather than a gRPC call.

Decoding a token through two stages is one ``Relay`` there and its answer back, and both ends
wait idle for it (each stage for the other's compute): over gRPC a frame reached a stage waiting
idle in 1.39 ms at 16 bytes and 1.62 ms at 256 KiB, against 0.59 and 0.83 over a plain socket
(``benchmarks/frame_hop.py``, this 2-core machine), and cost both ends about twice the CPU. So
where the stages have their pipeline streams (:mod:`.pipe_stream`: one datacenter, no shaped
link) a ``Relay`` goes to the listener the next stage has for them, as a call on a connection of
calls (its own hello, after TLS where the worker holds a leaf): the request length-prefixed, the
answer length-prefixed with a status first, the same statuses the gRPC method answers
(:func:`dmsc.runtime.transport.rpc.status_of`). The answering side runs the very handler
``Relay`` runs (``StageWorker.relay``: the same checks, fencing and admission).

- A connection carries one call at a time; a caller keeps its idle connections to each address
  (several tokens of several sessions may be on their way at once, each on its own).
- A caller that stops waiting (its budget) closes that connection: the late answer is never
  read as another call's.
- A worker publishes its listener under the deployment's store by its gRPC address before it
  registers (:meth:`.PipeStream.publish_calls`); a worker that published none is called over gRPC.
- A connection that fails is closed and reported as gRPC reports a peer that went away
  (UNAVAILABLE), which :func:`.relay.hand_on` answers as before: the registry is asked whether the
  stage moved, and the call goes once more to the new address. A call is never sent again on its
  own: the stage may have run it (a session's keys and values would take the token twice).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import grpc

from dmsc.runtime.compute.pipe_stream import PipeStream, read_exact
from dmsc.runtime.transport.rpc import MAX_MESSAGE_BYTES, status_of

_LEN = struct.Struct("!Q")
_CODES = {code.value[0]: code for code in grpc.StatusCode}

log = logging.getLogger(__name__)


class CallFailed(Exception):
    """A call over a stream answered with a status other than OK, or failed on the way (as gRPC
    reports a peer gone: UNAVAILABLE; out of time: DEADLINE_EXCEEDED)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:  # as grpc.RpcError's
        return self._code

    def details(self) -> str:
        return self._details


def _answer(code: grpc.StatusCode, body: bytes) -> bytes:
    return _LEN.pack(len(body) + 1) + bytes([code.value[0]]) + body


def serve(
    conn: socket.socket,
    answer: Callable[[bytes], bytes],
    max_bytes: int,
    refuse: Callable[[str], None],
    logger: Any = log,
) -> None:
    """Answer the calls of one connection with ``answer`` (a ``bytes_handler``'s function),
    one at a time, until it closes; a request over ``max_bytes`` is answered
    RESOURCE_EXHAUSTED before it is read, and the connection closed."""
    head = bytearray(_LEN.size)
    while read_exact(conn, memoryview(head)):
        (n,) = _LEN.unpack(head)
        if n > max_bytes:
            why = f"a call of {n:,} bytes, over the limit of {max_bytes:,}"
            conn.sendall(_answer(grpc.StatusCode.RESOURCE_EXHAUSTED, why.encode()))
            refuse(why)
            return
        data = bytearray(n)
        if not read_exact(conn, memoryview(data)):
            return
        try:
            reply = _answer(grpc.StatusCode.OK, answer(bytes(data)))
        except Exception as exc:  # answered with its status, as the gRPC method would
            code = status_of(exc)
            if code is None:
                code = grpc.StatusCode.UNKNOWN
                logger.warning("a call over a stream failed: %r", exc)
            reply = _answer(code, str(exc).encode())
        conn.sendall(reply)


def answering(pipe: PipeStream, answer: Callable[[bytes], bytes]) -> None:
    """Have ``pipe``'s listener answer connections of calls with ``answer`` (``Relay``'s
    handler), as the gRPC method would: its limit on a request too."""
    pipe.calls = functools.partial(
        serve, answer=answer, max_bytes=MAX_MESSAGE_BYTES, refuse=pipe.refuse, logger=pipe.log
    )


class StreamCalls:
    """A worker's calls to other workers' listeners (their gRPC addresses published with
    :meth:`.PipeStream.publish_calls`), over connections kept open."""

    def __init__(self, pipe: PipeStream) -> None:
        self.pipe = pipe
        self._at: dict[str, str | None] = {}  # a gRPC address: its listener (None: none)
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def _listener(self, service: str) -> str | None:
        if service not in self._at:
            self._at[service] = self.pipe.calls_address(service)
        return self._at[service]

    def _take(self, at: str) -> socket.socket:
        with self._lock:
            idle = self._idle.get(at)
            if idle:
                return idle.pop()
        try:
            return self.pipe.dial(at, self.pipe.call_hello())
        except OSError as exc:
            why = f"cannot connect to {at}: {exc}"
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, why) from None

    def call(self, service: str, data: bytes, wait_s: float) -> bytes | None:
        """The answer of the worker at the gRPC address ``service`` to ``data``, waiting at most
        ``wait_s`` (:class:`CallFailed` unless OK); None where it takes no calls on a stream."""
        at = self._listener(service)
        if at is None:
            return None
        if len(data) > MAX_MESSAGE_BYTES:  # refused before it is sent, as gRPC's client does
            why = f"a call of {len(data):,} bytes, over the limit of {MAX_MESSAGE_BYTES:,}"
            raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        sock = self._take(at)
        kept = False
        try:
            sock.settimeout(wait_s)
            sock.sendall(_LEN.pack(len(data)))
            sock.sendall(data)
            head = bytearray(_LEN.size)
            if not read_exact(sock, memoryview(head)):
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"{at} closed the connection")
            body = bytearray(_LEN.unpack(head)[0])
            if not body or not read_exact(sock, memoryview(body)):
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"{at} closed the connection")
            kept = True
        except TimeoutError:  # socket.timeout: the late answer must not meet another call
            raise CallFailed(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer from {at} within {wait_s:.3g} s"
            ) from None
        except OSError as exc:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"{at}: {exc}") from None
        finally:
            if kept:
                with self._lock:
                    self._idle.setdefault(at, []).append(sock)
            else:
                sock.close()
        code = _CODES.get(body[0], grpc.StatusCode.UNKNOWN)
        if code != grpc.StatusCode.OK:
            raise CallFailed(code, body[1:].decode(errors="replace"))
        return bytes(body[1:])

    def forget(self, service: str) -> None:
        """Look ``service``'s listener up again at its next call (it may have moved)."""
        self._at.pop(service, None)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.close()
