"""The pipeline's TCP streams (:mod:`dmsc.runtime.compute.pipe_stream`): frames arrive whole in
the receiver's inbox through ``deliver`` (as ``Push`` takes them), in order per neighbour; a
connection without the token, a frame over the limit and a frame ``deliver`` refuses are closed;
a new epoch opens new streams; a send to a stage that is gone fails the step's flush (the next
send connects again), and an abandoned flush ends at once; where the process holds a
certificate the streams are mutual TLS and a plain connection is refused.

Stages are objects of this process meeting in a TCPStore hosted here (port 0), as the workers of
a deployment meet in the control plane's.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dmsc.runtime.compute.inbox import Aborted, Inbox
from dmsc.runtime.compute.pipe_stream import HEADER_SLACK, MAGIC, PipeStream
from dmsc.runtime.transport import tls
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.runtime.transport.streams import hello
from dmsc.runtime.transport.wire import Kind, decode

NEVER = lambda: False  # noqa: E731  (a wait nobody abandons)
TOKEN = "secret"


def _store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]


def _stage(store: Any, stage: int, inbox: Inbox, max_bytes: int = 1 << 20) -> PipeStream:
    def deliver(data: bytes) -> None:
        f = decode(data)
        if not bool(torch.isfinite(f.tensor).all()):
            raise BadRequest("not finite")
        inbox.put(f.kind, f.step, f.microbatch, f.tensor, f.epoch)

    return PipeStream(f"127.0.0.1:{store.port}", stage, 0, 0, 10.0, deliver, max_bytes, token=TOKEN)


def _end() -> float:
    return time.monotonic() + 30


@contextlib.contextmanager
def _pair() -> Iterator[tuple[list[Inbox], PipeStream, PipeStream]]:
    """Stages 0 and 1, each with its inbox, ready in epoch 0; closed after."""
    store = _store()
    boxes = [Inbox(), Inbox()]
    s0, s1 = (_stage(store, s, boxes[s]) for s in (0, 1))
    try:
        for s in (s0, s1):
            s.ready(0, NEVER, _end())
        yield boxes, s0, s1
    finally:
        s0.close()
        s1.close()


def test_frames_arrive_whole_in_the_neighbours_inbox_and_each_epoch_has_its_streams() -> None:
    with _pair() as (boxes, s0, s1):
        acts = [torch.randn(2, 8, 16) for _ in range(3)]
        for mb, a in enumerate(acts):
            n = s0.send(1, Kind.ACTIVATION, 5, mb, a)
            assert n > a.numel() * 4  # the payload and its wire header
        grad = torch.randn(2, 8, 16)
        s1.send(0, Kind.GRADIENT, 5, 0, grad)
        s0.flush(NEVER, _end())
        s1.flush(NEVER, _end())
        for mb, a in reversed(list(enumerate(acts))):  # taken in any order
            assert torch.equal(boxes[1].get(Kind.ACTIVATION, 5, mb, 5.0), a)
        assert torch.equal(boxes[0].get(Kind.GRADIENT, 5, 0, 5.0), grad)
        first = s0._senders[1]
        for box in boxes:  # a recovery moves every worker to the next epoch
            box.epoch = 1
        for s in (s0, s1):
            s.ready(1, NEVER, _end())
        assert not s0._senders  # the old epoch's streams closed
        s0.send(1, Kind.ACTIVATION, 6, 0, acts[0])
        s0.flush(NEVER, _end())
        assert torch.equal(boxes[1].get(Kind.ACTIVATION, 6, 0, 5.0), acts[0])
        assert s0._senders[1] is not first


def _raw(stream: PipeStream, said: bytes) -> socket.socket:
    host, _, port = stream.address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(said)
    return sock


def _counted(stream: PipeStream, refused: int) -> bool:
    """Whether ``stream`` counts ``refused`` refusals within 5 s (its reader threads count a
    refusal as they close the connection, the client may see the close first)."""
    deadline = time.monotonic() + 5
    while stream.refused < refused and time.monotonic() < deadline:
        time.sleep(0.01)
    return stream.refused == refused


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_without_the_token_or_with_a_frame_over_the_limit_is_closed() -> None:
    store = _store()
    box = Inbox()
    s1 = _stage(store, 1, box, max_bytes=4096)
    try:
        assert _closed(_raw(s1, MAGIC + bytes(32)))  # no token
        assert _closed(_raw(s1, hello("another", MAGIC)))
        over = (4096 + HEADER_SLACK + 1).to_bytes(8, "big")
        assert _closed(_raw(s1, hello(TOKEN, MAGIC) + over))  # refused before it is read
        assert _counted(s1, 3)
    finally:
        s1.close()


def test_a_frame_the_receiver_refuses_closes_the_stream_and_fails_nothing_else() -> None:
    with _pair() as (boxes, s0, s1):
        s0.send(1, Kind.ACTIVATION, 1, 0, torch.full((2, 3), float("nan")))
        s0.flush(NEVER, _end())  # written: the refusal is the receiver's
        assert _counted(s1, 1)
        with pytest.raises(TimeoutError):
            boxes[1].get(Kind.ACTIVATION, 1, 0, 0.2)


def test_a_send_to_a_stage_that_is_gone_fails_the_flush_and_an_abandoned_flush_ends() -> None:
    with _pair() as (_, s0, s1):
        s1.close()  # its listener gone: refused (closed again at the end, harmless)
        s0.send(1, Kind.ACTIVATION, 1, 0, torch.zeros(2, 3))
        with pytest.raises(RuntimeError, match="stream to stage 1 failed"):
            s0.flush(NEVER, _end())
        assert not s0._senders and "stream to stage 1 failed" in (s0.dropped or "")
        s0.send(1, Kind.ACTIVATION, 1, 0, torch.zeros(2, 3))  # connects again: still gone
        with pytest.raises(RuntimeError, match="stream to stage 1 failed"):
            s0.flush(NEVER, _end())
        s0.ready(1, NEVER, _end())
        s0.send(1, Kind.ACTIVATION, 2, 0, torch.zeros(2, 3))  # stage 1 never publishes epoch 1
        t0 = time.monotonic()
        with pytest.raises(Aborted):
            s0.flush(lambda: time.monotonic() - t0 > 0.2, _end())
        assert time.monotonic() - t0 < 2.0


def test_with_a_certificate_the_streams_are_mutual_tls_and_a_plain_connection_is_refused(
    tmp_path: Path,
) -> None:
    tls.install_authority(tmp_path)  # this process's leaf: both stages present it
    try:
        with _pair() as (boxes, s0, s1):
            x = torch.randn(2, 8, 16)
            s0.send(1, Kind.ACTIVATION, 3, 0, x)
            s0.flush(NEVER, _end())
            assert torch.equal(boxes[1].get(Kind.ACTIVATION, 3, 0, 5.0), x)
            assert isinstance(s0._senders[1].sock, ssl.SSLSocket)
            assert _closed(_raw(s1, hello(TOKEN, MAGIC)))  # no handshake: refused
            # a failed handshake closes the socket inside wrap_socket, before the refusal is
            # counted: the count may come a moment after the client saw the close
            assert _counted(s1, 1)
    finally:
        tls.install(None)


def test_connections_past_the_bound_are_closed_at_once_and_a_silent_one_times_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("dmsc.runtime.compute.pipe_stream.HELLO_TIMEOUT_S", 3.0)
    store = _store()
    s1 = _stage(store, 1, Inbox())
    s1.max_connections = 2
    try:
        silent = [_raw(s1, b"") for _ in range(2)]  # they hold both places, saying nothing
        time.sleep(0.1)
        t0 = time.monotonic()
        assert _closed(_raw(s1, b""))  # the third: closed at once, not at the hello's timeout
        assert time.monotonic() - t0 < 2.0
        assert all(_closed(s) for s in silent)  # the silent ones at the hello's timeout
        deadline = time.monotonic() + 5
        while s1._open and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s1._open == 0 and _counted(s1, 1)
    finally:
        s1.close()
