"""gRPC without code generation: generic handlers whose messages are bytes.

Control messages are JSON objects (:mod:`.messages`); data-plane messages are :mod:`.wire` frames.
A request travels as a client stream of pieces of at most :data:`CHUNK_BYTES` (the most the
server's gRPC core buffers at once), and each method has its own limit on the whole request
(:data:`CONTROL_BYTES` for a JSON control message, :data:`MAX_MESSAGE_BYTES` for a frame): a
request over it is refused (RESOURCE_EXHAUSTED) as soon as its pieces pass the limit, so a small
call such as ``Status`` cannot make a server hold 200 MB. The service credential is checked on
the call's metadata, before any of the request is read: a call without it is refused without its
body being received. A handler that raises :class:`BadRequest` (or a wire error) answers
INVALID_ARGUMENT with the reason, one that raises :class:`DataLost` (stored data the request
names is missing or corrupt) DATA_LOSS, one whose wait for a peer's frame ran out
(TimeoutError) DEADLINE_EXCEEDED with what it waited for, and the server keeps serving. Using
generic handlers keeps grpcio-tools (and its protobuf) out of the process that also imports
OR-Tools.

Where the process holds a leaf certificate (:mod:`.tls`), servers and channels are mutual TLS
and a fenced epoch's certificate is refused; the service credential is checked as well.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc
from pydantic import BaseModel, ValidationError

from dmsc.runtime.transport import tls
from dmsc.runtime.transport.calls import PooledCall
from dmsc.runtime.transport.messages import explain
from dmsc.runtime.transport.replies import Reply, parse_reply

# The largest whole message: a data-plane frame (256 MiB of payload and its header) or a reply.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024 + 4096
CONTROL_BYTES = 1 << 20  # a JSON control request (prompts, settings, paths) at most
CHUNK_BYTES = 1 << 22  # a request's pieces: what a server receives in one gRPC message
# A client sends pieces and takes replies up to the largest message; a server takes pieces.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", CHUNK_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A server's handler threads are named so (a thread dump, or a test counting the client's own).
SERVER_THREADS = "dmsc-serve"
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", CHUNK_BYTES),
]


class BadRequest(ValueError):
    """The request cannot be served; the message is the reason sent back."""


class DataLost(RuntimeError):
    """Stored data the request names (a checkpoint file) is missing or fails its check: answered
    DATA_LOSS, so that a caller can tell it from a bad request and try other data."""


class Abandoned(RuntimeError):
    """The work was given up on purpose (a newer epoch, a dropped step): answered ABORTED."""


class NoRoom(RuntimeError):
    """A worker has no room for more (an inference session's keys and values): answered
    RESOURCE_EXHAUSTED, so that a caller can try another replica or tell its client to retry."""


def _identity(b: bytes) -> bytes:
    return b


def _pieces(data: bytes) -> Iterator[bytes]:
    """``data`` as the pieces a request travels in (one, empty, for an empty request)."""
    if len(data) <= CHUNK_BYTES:
        yield data
        return
    view = memoryview(data)
    for start in range(0, len(data), CHUNK_BYTES):
        yield bytes(view[start : start + CHUNK_BYTES])


def _receive(pieces: Iterator[bytes], context: grpc.ServicerContext, max_bytes: int) -> bytes:
    """The request of ``pieces``, refused (RESOURCE_EXHAUSTED) as soon as it passes
    ``max_bytes``: the rest is never read."""
    parts: list[bytes] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > max_bytes:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this method takes requests of {max_bytes:,} bytes at most",
            )
        parts.append(piece)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status a handler's exception is answered with (None: not one of ours, UNKNOWN)."""
    for kind, code in _STATUSES:
        if isinstance(exc, kind):
            return code
    return None


_STATUSES: tuple[tuple[Any, grpc.StatusCode], ...] = (
    (DataLost, grpc.StatusCode.DATA_LOSS),
    (NoRoom, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((BadRequest, ValueError), grpc.StatusCode.INVALID_ARGUMENT),
    (Abandoned, grpc.StatusCode.ABORTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),  # a peer's frame it waited for never came
)


def _answered(work: Callable[[], bytes], context: grpc.ServicerContext) -> bytes:
    """``work()``'s answer, or the status its exception stands for (with its message)."""
    try:
        return work()
    except Exception as exc:
        code = status_of(exc)
        if code is None:
            raise
        context.abort(code, str(exc))
        raise  # unreachable: abort raises


def bytes_handler(
    fn: Callable[[bytes], bytes], max_bytes: int = MAX_MESSAGE_BYTES
) -> grpc.RpcMethodHandler:
    """A method whose request (at most ``max_bytes``) and reply are bytes."""

    def handle(pieces: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        request = _receive(pieces, context, max_bytes)
        return _answered(lambda: fn(request), context)

    return grpc.stream_unary_rpc_method_handler(
        handle, request_deserializer=_identity, response_serializer=_identity
    )


def json_handler(
    fn: Callable[[dict[str, Any]], dict[str, Any]], max_bytes: int = CONTROL_BYTES
) -> grpc.RpcMethodHandler:
    def wrapped(request: bytes) -> bytes:
        try:
            payload = json.loads(request or b"{}")
        except json.JSONDecodeError as exc:
            raise BadRequest(f"malformed JSON: {exc.msg}") from None
        if not isinstance(payload, dict):
            raise BadRequest("expected a JSON object")
        return json.dumps(fn(payload)).encode()

    return bytes_handler(wrapped, max_bytes)


M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", bound=Reply)


def parse(model: type[M], payload: bytes | dict[str, Any]) -> M:
    """``payload`` as a ``model``; :class:`BadRequest` names each bad field and why."""
    try:
        if isinstance(payload, dict):
            return model.model_validate(payload)
        return model.model_validate_json(payload or b"{}")
    except ValidationError as exc:
        raise BadRequest(explain(exc, model.__name__)) from None


def reply_json(out: Reply | dict[str, Any], reply: type[Reply] | None = None) -> dict[str, Any]:
    """A handler's answer as the JSON it sends: a :class:`Reply` as its fields set; a dict
    through ``reply`` (its model) when given, a :class:`BadReply` naming the field that does
    not fit (a server error: nothing is sent)."""
    if isinstance(out, Reply):
        return out.wire()
    return out if reply is None else parse_reply(reply, out).wire()


def message_handler(
    model: type[M],
    fn: Callable[[M], Reply | dict[str, Any]],
    max_bytes: int = CONTROL_BYTES,
    reply: type[Reply] | None = None,
) -> grpc.RpcMethodHandler:
    """A JSON method whose request (at most ``max_bytes``) is checked against ``model`` (one of
    :mod:`dmsc.runtime.transport.messages`) before ``fn`` sees it, and whose answer goes out
    through its reply model (:mod:`dmsc.runtime.transport.replies`)."""
    return bytes_handler(message_fn(model, fn, reply), max_bytes)


def message_fn(
    model: type[M], fn: Callable[[M], Reply | dict[str, Any]], reply: type[Reply] | None = None
) -> Callable[[bytes], bytes]:
    """:func:`message_handler`'s work on the request's bytes: its answer's bytes."""

    def wrapped(request: bytes) -> bytes:
        return json.dumps(reply_json(fn(parse(model, request)), reply)).encode()

    return wrapped


def waiting_handler(
    model: type[M],
    fn: Callable[[M, threading.Event], Reply | dict[str, Any]],
    max_bytes: int = CONTROL_BYTES,
    reply: type[Reply] | None = None,
) -> grpc.RpcMethodHandler:
    """:func:`message_handler` for a method that waits for long work: ``fn``'s event is set when
    the call ends early (the client cancelled or went away), so that the work can stop."""

    def handle(pieces: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        request = _receive(pieces, context, max_bytes)
        gone = threading.Event()
        context.add_callback(gone.set)

        def work() -> bytes:
            return json.dumps(reply_json(fn(parse(model, request), gone), reply)).encode()

        return _answered(work, context)

    return grpc.stream_unary_rpc_method_handler(
        handle, request_deserializer=_identity, response_serializer=_identity
    )


def stream_handler(
    model: type[M],
    fn: Callable[[M, threading.Event], Iterator[Reply | dict[str, Any]]],
    max_bytes: int = CONTROL_BYTES,
    reply: Callable[[dict[str, Any]], Reply] | None = None,
) -> grpc.RpcMethodHandler:
    """A server-streaming JSON method: ``fn`` yields the reply's messages one by one (each sent
    as it comes). ``fn``'s event is set when the call ends early (the client cancelled or went
    away), so that the work behind the stream can stop. ``reply`` types each message (a dict
    that does not fit raises :class:`BadReply`)."""

    def handle(pieces: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        request = _receive(pieces, context, max_bytes)
        gone = threading.Event()
        context.add_callback(gone.set)
        try:
            for item in fn(parse(model, request), gone):
                if isinstance(item, dict) and reply is not None:
                    item = reply(item)
                yield json.dumps(reply_json(item)).encode()
        except (BadRequest, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Abandoned as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))

    return grpc.stream_stream_rpc_method_handler(
        handle, request_deserializer=_identity, response_serializer=_identity
    )


class _CredentialCheck(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call that does not carry the deployment's service credential, on the call's
    metadata alone: the refusing handler takes the request as a stream and never reads it, so
    none of a stranger's body is received."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}"

        def deny(pieces: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong service credential")
            return b""

        self._deny = grpc.stream_unary_rpc_method_handler(
            deny, request_deserializer=_identity, response_serializer=_identity
        )

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") == self.expected:
            return continuation(details)
        return self._deny


def serve(
    service: str,
    methods: dict[str, grpc.RpcMethodHandler],
    address: str = "127.0.0.1:0",
    workers: int = 16,
    token: str | None = None,
    leaf: tls.Leaf | None = None,
    fences: tls.FenceFloors | None = None,
) -> tuple[grpc.Server, int]:
    """Start a server for ``service`` on ``address``; returns it and its port. With ``token``,
    only callers that present it (``authorization: Bearer <token>``) are served. With a
    ``leaf`` (default: the process's, :func:`.tls.current`), only callers with a leaf of its
    authority are served, and with ``fences`` only those whose leaf is not of a fenced epoch.
    A server on the process's leaf follows its renewals (:func:`.tls.following_credentials`)."""
    interceptors = [_CredentialCheck(token)] if token else []
    own, leaf = leaf is None, leaf or tls.current()
    if fences is not None:
        methods = {name: tls.fence_checked(h, fences) for name, h in methods.items()}
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=SERVER_THREADS),
        options=SERVER_OPTIONS,
        interceptors=interceptors,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    if leaf is None:
        port = server.add_insecure_port(address)
    else:
        creds = tls.following_credentials() if own else tls.server_credentials(leaf)
        port = server.add_secure_port(address, creds)
    server.start()
    return server, port


class Client:
    """Calls one service at one address; JSON or raw bytes."""

    def __init__(
        self,
        address: str,
        service: str,
        timeout_s: float = 30.0,
        token: str | None = None,
        leaf: tls.Leaf | None = None,
        via: Callable[[str, bytes, float], bytes | None] | None = None,
    ) -> None:
        """With a ``leaf`` (default: the process's, :func:`.tls.current`) the channel is mutual
        TLS, the server checked against the leaf's authority. On the process's leaf, the
        channel is opened anew with its renewal (:func:`.tls.renew`) at the next call. With
        ``via`` (method, request, wait) a call is made that way where it answers (None: not
        this method), as a worker's step calls are on its stream (:mod:`.stream_calls`)."""
        self.via = via
        self.address = address
        self.service = service
        self.timeout_s = timeout_s
        self.metadata = [("authorization", f"Bearer {token}")] if token else None
        self._own, self._leaf = leaf is None, leaf or tls.current()
        self.channel = self._open(self._leaf)
        self._retired: grpc.Channel | None = None  # the channel before the last renewal
        self._renewing = threading.Lock()
        self._stubs: dict[tuple[str, bool], Any] = {}

    def _open(self, leaf: tls.Leaf | None) -> grpc.Channel:
        if leaf is None:
            return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        creds = tls.channel_credentials(leaf)
        options = [*CHANNEL_OPTIONS, *tls.channel_options()]
        return grpc.secure_channel(self.address, creds, options=options)

    def _follow(self) -> None:
        """A new channel with the process's renewed leaf. Calls in flight finish on the old
        one, kept open until the next renewal (a third of a leaf's lifetime later)."""
        now = tls.current()
        if not self._own or now is self._leaf or now is None or self._leaf is None:
            return
        with self._renewing:
            if now is self._leaf:
                return
            if self._retired is not None:
                self._retired.close()
            self._retired, self.channel = self.channel, self._open(now)
            self._leaf, self._stubs = now, {}

    def _stub(self, method: str, data: bytes) -> Any:
        """The call for ``method`` with ``data``: a plain unary call for a request that fits in
        one piece (the server's stream handler takes it as a stream of one), pieces otherwise.
        grpcio's client starts a thread per client-streaming call to consume the request
        iterator; the unary call starts none, which halved the small-message round trip
        (benchmarks/transport.py)."""
        self._follow()
        unary = len(data) <= CHUNK_BYTES
        key = (method, unary)
        if key not in self._stubs:
            make = self.channel.unary_unary if unary else self.channel.stream_unary
            self._stubs[key] = make(
                f"/{self.service}/{method}",
                request_serializer=_identity,
                response_deserializer=_identity,
            )
        return self._stubs[key]

    def raw(self, method: str, data: bytes, timeout_s: float | None = None) -> bytes:
        if self.via is not None:
            got = self.via(method, data, timeout_s or self.timeout_s)
            if got is not None:
                return got
        request = data if len(data) <= CHUNK_BYTES else _pieces(data)
        result: bytes = self._stub(method, data)(
            request, timeout=timeout_s or self.timeout_s, metadata=self.metadata
        )
        return result

    def raw_future(self, method: str, data: bytes, timeout_s: float | None = None) -> Any:
        """Send without waiting: a grpc future whose ``result()`` is the reply."""
        request = data if len(data) <= CHUNK_BYTES else _pieces(data)
        return self._stub(method, data).future(
            request, timeout=timeout_s or self.timeout_s, metadata=self.metadata
        )

    def raw_pooled(self, method: str, data: bytes, timeout_s: float | None = None) -> PooledCall:
        """Send without waiting, as a blocking call on a thread that stays (:mod:`.calls`): no
        thread started per call. For short calls with a deadline (it cannot be cancelled)."""
        return PooledCall(lambda: self.raw(method, data, timeout_s))

    def call(
        self, method: str, payload: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(
            self.raw(method, json.dumps(payload or {}).encode(), timeout_s)
        )
        return out

    def send(self, method: str, msg: BaseModel, timeout_s: float | None = None) -> dict[str, Any]:
        """Call ``method`` with a typed message; the reply as a JSON object."""
        out: dict[str, Any] = json.loads(
            self.raw(method, msg.model_dump_json(exclude_none=True).encode(), timeout_s)
        )
        return out

    def ask(self, method: str, msg: BaseModel, reply: type[R], timeout_s: float | None = None) -> R:
        """Call ``method`` with a typed message; the reply as its model (:class:`BadReply` names
        the field of a reply that does not fit)."""
        data = self.raw(method, msg.model_dump_json(exclude_none=True).encode(), timeout_s)
        return parse_reply(reply, data)

    def send_future(self, method: str, msg: BaseModel, timeout_s: float | None = None) -> Any:
        """Send a typed message without waiting: a grpc future whose ``result()`` is the reply
        (JSON bytes)."""
        return self.raw_future(method, msg.model_dump_json(exclude_none=True).encode(), timeout_s)

    def send_pooled(
        self, method: str, msg: BaseModel, timeout_s: float | None = None
    ) -> PooledCall:
        """:meth:`send_future` on a thread that stays (:meth:`raw_pooled`)."""
        return self.raw_pooled(method, msg.model_dump_json(exclude_none=True).encode(), timeout_s)

    def stream(self, method: str, msg: BaseModel, timeout_s: float | None = None) -> Any:
        """Call a server-streaming method: an iterator of the reply's JSON objects, as they
        arrive (``cancel()`` on it ends the call)."""
        data = msg.model_dump_json(exclude_none=True).encode()
        self._follow()
        unary = len(data) <= CHUNK_BYTES
        make = self.channel.unary_stream if unary else self.channel.stream_stream
        call = make(
            f"/{self.service}/{method}",
            request_serializer=_identity,
            response_deserializer=json.loads,
        )
        return call(
            data if unary else _pieces(data),
            timeout=timeout_s or self.timeout_s,
            metadata=self.metadata,
        )

    def close(self) -> None:
        if self._retired is not None:
            self._retired.close()
        self.channel.close()
