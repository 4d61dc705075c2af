"""Calls over a worker's pipeline listener (:mod:`dmsc.runtime.compute.relay_stream`): an answer
comes back on the caller's connection, kept for its next call; a handler's refusal keeps the
status the gRPC method would answer; a request over the limit is refused before it is read; a
caller that stops waiting closes that connection, so that the late answer never reaches another
call; a worker that publishes none is called over gRPC; a listener gone fails the call as a peer
gone (UNAVAILABLE), and a hello without the token is closed.

Workers are objects of this process meeting in a TCPStore hosted here (port 0).
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch.distributed as dist

from dmsc.runtime.compute.pipe_stream import CALL_MAGIC, PipeStream, hello
from dmsc.runtime.compute.relay_stream import CallFailed, StreamCalls, answering
from dmsc.runtime.transport.rpc import BadRequest, NoRoom

TOKEN = "secret"
SERVICE = "127.0.0.1:1"  # the gRPC address the answering worker publishes its listener under


def _stream(store: Any, stage: int, max_bytes: int = 1 << 20) -> PipeStream:
    def nothing(data: bytes) -> None:
        raise AssertionError("no pipeline frames here")

    addr = f"127.0.0.1:{store.port}"
    return PipeStream(addr, stage, 0, 0, 10.0, nothing, max_bytes, token=TOKEN)


def _answer(data: bytes) -> bytes:
    """Echo, or refuse as the request says."""
    if data == b"bad":
        raise BadRequest("a bad request")
    if data == b"full":
        raise NoRoom("no room")
    if data == b"boom":
        raise RuntimeError("a bug")
    if data.startswith(b"sleep "):
        time.sleep(float(data.split()[1]))
    return b"echo " + data


@contextlib.contextmanager
def _pair(
    answer: Callable[[bytes], bytes] = _answer,
) -> Iterator[tuple[StreamCalls, PipeStream]]:
    """A caller's calls and the answering worker's listener (publishing under SERVICE)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    caller, callee = _stream(store, 0), _stream(store, 1)
    answering(callee, answer)
    callee.publish_calls(SERVICE)
    calls = StreamCalls(caller)
    try:
        yield calls, callee
    finally:
        calls.close()
        caller.close()
        callee.close()


def _refusals(pipe: PipeStream, n: int) -> None:
    """Wait until ``pipe`` counted ``n`` connections refused (its reader threads count them)."""
    deadline = time.monotonic() + 5
    while pipe.refused < n:
        assert time.monotonic() < deadline, pipe.refused
        time.sleep(0.01)
    assert pipe.refused == n


def _failed(calls: StreamCalls, data: bytes, wait_s: float = 5.0) -> CallFailed:
    with pytest.raises(CallFailed) as info:
        calls.call(SERVICE, data, wait_s)
    return info.value


def test_answers_come_back_on_one_kept_connection_and_concurrent_calls_get_their_own() -> None:
    with _pair() as (calls, _):
        assert calls.call(SERVICE, b"a", 5.0) == b"echo a"
        assert calls.call(SERVICE, b"", 5.0) == b"echo "
        assert sum(len(s) for s in calls._idle.values()) == 1  # one connection, kept
        got: list[bytes | None] = []
        threads = [
            threading.Thread(target=lambda i=i: got.append(calls.call(SERVICE, b"sleep 0.2", 5.0)))
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == [b"echo sleep 0.2"] * 3
        assert sum(len(s) for s in calls._idle.values()) == 3  # each call had a connection


def test_a_refusal_keeps_its_status_and_the_connection_serves_the_next_call() -> None:
    with _pair() as (calls, callee):
        bad = _failed(calls, b"bad")
        assert (bad.code(), bad.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "a bad request")
        assert _failed(calls, b"full").code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _failed(calls, b"boom").code() == grpc.StatusCode.UNKNOWN
        assert calls.call(SERVICE, b"after", 5.0) == b"echo after"
        assert callee.refused == 0


def test_a_request_over_the_limit_is_refused_before_it_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dmsc.runtime.compute import relay_stream

    monkeypatch.setattr(relay_stream, "MAX_MESSAGE_BYTES", 1000)
    with _pair() as (calls, callee):
        over = _failed(calls, bytes(1001))  # refused by the caller, as gRPC's client would
        assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1,001 bytes" in over.details()
        assert calls.call(SERVICE, bytes(1000), 5.0) == b"echo " + bytes(1000)
        # a hostile caller saying more: answered so and closed, its bytes never read
        hostile = callee.dial(callee.address, hello(TOKEN, CALL_MAGIC))
        hostile.sendall(struct.pack("!Q", 1 << 40))
        head = hostile.recv(9)
        assert head[8] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        hostile.close()
        _refusals(callee, 1)


def test_a_caller_that_stops_waiting_never_reads_the_late_answer_as_another_calls() -> None:
    with _pair() as (calls, _):
        late = _failed(calls, b"sleep 0.5", wait_s=0.1)
        assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not any(calls._idle.values())  # that connection was closed
        assert calls.call(SERVICE, b"next", 5.0) == b"echo next"


def test_a_worker_without_calls_is_called_over_grpc_and_a_listener_gone_fails_the_call() -> None:
    with _pair() as (calls, callee):
        assert calls.call("127.0.0.1:2", b"x", 5.0) is None  # published nothing
        assert calls.call(SERVICE, b"x", 5.0) == b"echo x"
        callee.close()  # its listener and the connections it reads
        gone = _failed(calls, b"x")  # on the kept connection
        assert gone.code() == grpc.StatusCode.UNAVAILABLE
        gone = _failed(calls, b"x")  # a new one, refused
        assert gone.code() == grpc.StatusCode.UNAVAILABLE and "cannot connect" in gone.details()


def test_a_call_hello_without_the_token_or_to_a_worker_taking_no_calls_is_closed() -> None:
    with _pair() as (_, callee):
        wrong = callee.dial(callee.address, hello("other", CALL_MAGIC))
        assert wrong.recv(1) == b""  # closed, nothing answered
        wrong.close()
        callee.calls = None
        plain = callee.dial(callee.address, hello(TOKEN, CALL_MAGIC))
        assert plain.recv(1) == b""
        plain.close()
        _refusals(callee, 2)
