"""Calls on threads that stay (:mod:`dmsc.runtime.transport.calls`) answer as grpc's futures do,
against a real gRPC server, and start no thread per call."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from dmsc.runtime.transport import calls
from dmsc.runtime.transport.calls import PooledCall
from dmsc.runtime.transport.rpc import SERVER_THREADS, BadRequest, Client, bytes_handler, serve


def _echo(data: bytes) -> bytes:
    if data == b"bad":
        raise BadRequest("refused")
    return data[::-1]


@pytest.fixture
def client() -> Client:
    release = threading.Event()

    def slow(data: bytes) -> bytes:
        release.wait(60)
        return b"late"

    server, port = serve("t.Calls", {"Echo": bytes_handler(_echo), "Slow": bytes_handler(slow)})
    c = Client(f"127.0.0.1:{port}", "t.Calls")
    yield c
    release.set()
    c.close()
    server.stop(None)


def test_a_pooled_call_answers_as_the_grpc_future_does(client: Client) -> None:
    pooled, future = client.raw_pooled("Echo", b"abc"), client.raw_future("Echo", b"abc")
    assert pooled.result(timeout=10) == future.result(timeout=10) == b"cba"
    assert pooled.done() and pooled.exception() is None and not pooled.cancelled()
    seen: list[object] = []
    pooled.add_done_callback(seen.append)  # done already: called at once, with the call
    assert seen == [pooled]


def test_a_refused_call_carries_the_status_and_reason(client: Client) -> None:
    pooled, future = client.raw_pooled("Echo", b"bad"), client.raw_future("Echo", b"bad")
    for call in (pooled, future):
        exc = call.exception(timeout=10)
        assert isinstance(exc, grpc.RpcError)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details() == "refused"
        with pytest.raises(grpc.RpcError):
            call.result()


def test_a_call_still_running_times_out_as_grpc_says(client: Client) -> None:
    pooled = client.raw_pooled("Slow", b"", timeout_s=5)
    with pytest.raises(grpc.FutureTimeoutError):
        pooled.result(timeout=0.05)
    with pytest.raises(grpc.FutureTimeoutError):
        pooled.exception(timeout=0.05)
    assert not pooled.done() and not pooled.cancel()  # running: ends at its own deadline


def test_calls_one_after_another_start_no_thread_each(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc's ``.future()`` on an idle channel starts a thread (the channel's spin thread) for
    a call; the pool's threads stay, so calls in turn start none once the pool has one. The
    server runs in this process: its handler pool counts itself idle only after its answer is
    sent, so it may start a thread of its own between two calls (it did, under CI's load);
    those are not the client's and are not counted."""
    for _ in range(5):  # the pool's first thread
        client.raw_pooled("Echo", b"x").result(timeout=10)
    started: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        if not self.name.startswith(SERVER_THREADS):
            started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    for _ in range(50):
        client.raw_pooled("Echo", b"x").result(timeout=10)
    pooled = list(started)
    for _ in range(50):
        client.raw_future("Echo", b"x").result(timeout=10)
    assert pooled == [] and len(started) > 0  # the count sees grpc's threads


def test_a_call_not_yet_started_can_be_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "MAX_THREADS", 2)
    monkeypatch.setattr(calls, "_pool", None)  # a pool of two threads, for this test only
    gate = threading.Event()
    blockers = [PooledCall(lambda: gate.wait(5)) for _ in range(2)]
    queued = PooledCall(lambda: b"never")
    assert queued.cancel() and queued.cancelled() and queued.done()
    with pytest.raises(grpc.FutureCancelledError):
        queued.result()
    gate.set()
    assert all(b.result(timeout=10) for b in blockers)


def test_a_process_ends_without_waiting_for_a_call_in_flight(client: Client) -> None:
    """A call to a peer that never answers does not hold its process at exit (threads of
    ``concurrent.futures`` pools are joined at exit: it waited out the call's 60 s deadline)."""
    code = (
        "import sys, time\n"
        "from dmsc.runtime.transport.rpc import Client\n"
        f"c = Client({client.address!r}, 't.Calls')\n"
        "c.raw_pooled('Slow', b'', timeout_s=60)\n"
        "time.sleep(0.5)\n"
        "sys.exit(0)\n"
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], timeout=50, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 30


def test_a_thread_is_idle_again_before_its_caller_hears_the_answer() -> None:
    """The race the test above met on a loaded machine: a caller that sends its next call as
    soon as it has its answer found no idle thread (the thread was counted idle only after it
    answered) and started another. Read at the moment the answer is set, in the serving thread."""
    threads = calls._Threads()
    gate = threading.Event()
    seen: list[int] = []
    future = threads.submit(lambda: gate.wait(5))
    future.add_done_callback(lambda _: seen.append(threads._idle))  # runs as it is answered
    gate.set()
    assert future.result(timeout=10) is True
    assert seen == [1]
