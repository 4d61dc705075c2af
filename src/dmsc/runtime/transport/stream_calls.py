"""Calls on a kept TCP connection instead of gRPC, for the calls on a step's critical path: the
control plane's ``RunStep`` and ``RunWith`` to a stage worker, and a chained inference step's
``Relay`` from one stage to the next (:mod:`dmsc.runtime.compute.relay`).

Both ends of such a call wait idle for it (a stage for its step, the control plane for its
answer, a stage for the next one's part of a token), and a process waiting idle was reached
over gRPC in 1.39 ms for 16 bytes against 0.59 ms over a plain socket between threads, at about
twice the CPU (``benchmarks/frame_hop.py``, this 2-core machine): HTTP/2, gRPC's poller and its
handler threads. Written by hand for that measurement; the statuses and the limits are gRPC's.

- A stage worker answers calls on the listener of its pipeline streams
  (:class:`dmsc.runtime.compute.pipe_stream.PipeStream`): a connection of calls says its own
  hello (:data:`CALL_MAGIC` and the token's digest, inside TLS where the worker holds a leaf),
  and :func:`serve` answers its calls one after the other with the methods it was given, each
  with the handler its gRPC method runs and the same limit on a request.
- A call: ``[8 bytes: length][1 byte: the method name's length][the name][the request]``; its
  answer: ``[8 bytes: length][1 byte: status][the reply, or the reason]``. The status is the
  gRPC status the method would have answered with
  (:func:`dmsc.runtime.transport.rpc.status_of`); a caller whose certificate is of a fenced
  epoch is refused PERMISSION_DENIED, as the gRPC server refuses it.
- The worker publishes its listener under the deployment's store by its gRPC address, before
  it registers (:func:`publish`); a worker that published none is called over gRPC, and so is
  every method not in :data:`STREAMED`.
- :class:`StreamCalls` keeps idle connections per listener (one call at a time on each; calls
  in flight at once each have their own). A new connection carries calls once the worker said
  it took it (:data:`ACCEPTED`); one it refused or closed before that (none published there any
  more, its bound of connections reached) sends its call over gRPC instead: nothing of the call
  was sent, and the gRPC server has no such bound. A caller that stops waiting closes that
  connection, so the late answer is never read as another call's. A connection that fails raises
  :class:`CallFailed`, a ``grpc.RpcError`` whose ``code()`` is what gRPC would have said (a
  peer gone: UNAVAILABLE; out of time: DEADLINE_EXCEEDED), so callers handle both alike. A
  call is never sent twice on its own: the worker may have run it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import grpc

from dmsc.runtime.transport import tls
from dmsc.runtime.transport.rpc import CONTROL_BYTES, MAX_MESSAGE_BYTES, status_of
from dmsc.runtime.transport.streams import dial, hello, peer_name, read_exact, store_client

CALL_MAGIC = b"DMSCCALL"  # a connection of calls
ACCEPTED = b"\x01"  # what a worker says to a connection of calls it serves, before any call
CALLS_KEY = "ppstream/calls"  # under the store: each worker's listener, by its gRPC address
# the methods called on a stream, each with the most bytes its request may have (its gRPC
# method's limit on a stage worker)
STREAMED = {"RunStep": CONTROL_BYTES, "RunWith": MAX_MESSAGE_BYTES, "Relay": MAX_MESSAGE_BYTES}
_LEN = struct.Struct("!Q")
_CODES = {code.value[0]: code for code in grpc.StatusCode}

# what answers a method on a stream: request bytes to reply bytes, raising as a gRPC handler
Handler = Callable[[bytes], bytes]

log = logging.getLogger(__name__)


class CallFailed(grpc.RpcError):  # type: ignore[misc]  # grpc's classes are untyped
    """A call on a stream answered with a status other than OK, or failed on the way; read as
    a failed gRPC call is (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _answer(code: grpc.StatusCode, body: bytes) -> bytes:
    return _LEN.pack(len(body) + 1) + bytes([code.value[0]]) + body


def publish(store_address: str, service: str, listener: str, timeout_s: float = 30.0) -> None:
    """Say under the store at ``store_address`` that the worker whose gRPC address is
    ``service`` answers calls at ``listener``."""
    store_client(store_address, timeout_s).set(f"{CALLS_KEY}/{service}", listener)


def serve(
    conn: socket.socket,
    methods: dict[str, Handler],
    refuse: Callable[[str], None],
    logger: Any = log,
) -> None:
    """Answer the calls of one connection (its hello said) with ``methods`` (of
    :data:`STREAMED`), one at a time, until it closes; it is told :data:`ACCEPTED` first. A
    call to another method, or over its method's limit, is answered (UNIMPLEMENTED,
    RESOURCE_EXHAUSTED) before its request is read, and the connection closed (``refuse`` says
    why)."""
    conn.sendall(ACCEPTED)
    head = bytearray(_LEN.size + 1)
    name = bytearray(255)
    while read_exact(conn, memoryview(head)):
        n, size = _LEN.unpack(head[: _LEN.size])[0], head[-1]
        if n < 1 + size or not read_exact(conn, memoryview(name)[:size]):
            return
        method, want = name[:size].decode(errors="replace"), n - 1 - size
        handler, limit = methods.get(method), STREAMED.get(method, 0)
        if handler is None or want > limit:
            code, why = grpc.StatusCode.UNIMPLEMENTED, f"{method!r} is not answered on a stream"
            if handler is not None:
                code, why = (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    (f"{method} takes requests of {limit:,} bytes at most, not {want:,}"),
                )
            conn.sendall(_answer(code, why.encode()))
            refuse(why)
            return
        data = bytearray(want)
        if not read_exact(conn, memoryview(data)):
            return
        fenced = tls.fence_reason(peer_name(conn), tls.FENCES)  # as the gRPC server checks
        if fenced is not None:
            conn.sendall(_answer(grpc.StatusCode.PERMISSION_DENIED, fenced.encode()))
            continue
        conn.sendall(_answered(handler, bytes(data), logger))


def _answered(handler: Callable[[bytes], bytes], data: bytes, logger: Any) -> bytes:
    try:
        return _answer(grpc.StatusCode.OK, handler(data))
    except Exception as exc:  # answered with its status, as the gRPC method would
        code = status_of(exc)
        if code is None:
            code = grpc.StatusCode.UNKNOWN
            logger.warning("a call on a stream failed: %r", exc)
        return _answer(code, str(exc).encode())


class StreamCalls:
    """One process's calls to workers' listeners, found under the deployment's store at
    ``store_address``, over connections kept open."""

    def __init__(self, store_address: str, token: str | None, timeout_s: float = 30.0) -> None:
        self.store_address = store_address
        self.timeout_s = timeout_s  # to connect, or to look a listener up
        self._hello = hello(token, CALL_MAGIC)
        self._at: dict[str, str | None] = {}  # a gRPC address: its listener (None: none)
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def _listener(self, service: str) -> str | None:
        if service not in self._at:
            key = f"{CALLS_KEY}/{service}"
            try:
                store = store_client(self.store_address, self.timeout_s)
                self._at[service] = store.get(key).decode() if store.check([key]) else None
            except RuntimeError as exc:  # the store unreachable: gRPC this time, look again next
                log.warning("no stream listener looked up for %s: %s", service, exc)
                return None
        return self._at[service]

    def route(self, service: str) -> Callable[[str, bytes, float], bytes | None]:
        """What calls the worker at the gRPC address ``service`` on its stream (for
        :attr:`dmsc.runtime.transport.rpc.Client.via`)."""
        return lambda method, data, wait_s: self.call(service, method, data, wait_s)

    def _take(self, at: str, wait_s: float) -> socket.socket | None:
        """An idle connection to ``at``, or a new one the worker took (its :data:`ACCEPTED`
        read); None where it took none (refused, closed, full): that call goes over gRPC."""
        with self._lock:
            idle = self._idle.get(at)
            if idle:
                return idle.pop()
        within = min(self.timeout_s, wait_s)
        sock = None
        try:  # connected, its TLS handshake done and taken, within the call's own wait too
            sock = dial(at, self._hello, within)
            sock.settimeout(within)
            if sock.recv(1) == ACCEPTED:
                return sock
        except TimeoutError:
            if sock is not None:
                sock.close()
            why = f"not connected to {at} within {within:.3g} s"
            raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, why) from None
        except OSError as exc:
            log.info("no stream to %s (%s): over gRPC", at, exc)
        if sock is not None:
            sock.close()
        return None

    def call(self, service: str, method: str, data: bytes, wait_s: float) -> bytes | None:
        """The answer of the worker at the gRPC address ``service`` to ``method`` with
        ``data``, waiting at most ``wait_s`` (:class:`CallFailed` unless OK); None where that
        method goes over gRPC (not :data:`STREAMED`, or the worker published no listener)."""
        limit = STREAMED.get(method)
        if limit is None:
            return None
        at = self._listener(service)
        if at is None:
            return None
        if len(data) > limit:  # what the worker would answer, before anything is sent
            why = f"{method} takes requests of {limit:,} bytes at most, not {len(data):,}"
            raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        name = method.encode()
        sock = self._take(at, wait_s)
        if sock is None:
            return None
        kept = False
        try:
            sock.settimeout(wait_s)
            sock.sendall(_LEN.pack(len(data) + 1 + len(name)) + bytes([len(name)]) + name)
            sock.sendall(data)
            head = bytearray(_LEN.size)
            if not read_exact(sock, memoryview(head)):
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"{at} closed the connection")
            body = bytearray(_LEN.unpack(head)[0])
            if not body or not read_exact(sock, memoryview(body)):
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"{at} closed the connection")
            kept = True
        except TimeoutError:  # the late answer must not meet another call
            why = f"no answer from {at} within {wait_s:.3g} s"
            raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, why) from None
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

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.close()
