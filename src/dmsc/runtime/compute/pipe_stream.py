"""Pipeline frames inside one datacenter over one TCP stream to each neighbouring stage.

Where a replica's stages share one datacenter (no shaped link between them; ``StageLayout``'s
``pp_stream``, on by default, and not its ``pp_gloo``), a training step's activations and
gradients go to the neighbouring stage as wire frames (:mod:`dmsc.runtime.transport.wire`) on
a TCP connection of their own rather than as gRPC ``Push`` calls. Written by hand, not a
library's, because of what was measured (``benchmarks/frame_hop.py``, this 2-core machine, three
runs): a 256 KiB frame reached a stage waiting idle in 1.62-2.04 ms over ``Push`` (0.99-1.29 of
it inside gRPC: HTTP/2, the server's poller and handler threads) against 0.80-0.91 ms over a
plain socket between threads, and cost both ends 2.0 ms of CPU against 0.93 (0.82 against 0.28
back to back); gloo's
point-to-point (:mod:`.pipe_group`) took 1.1-1.4 ms to an idle stage and more CPU than gRPC. A
3-stage gpt-mini step (``benchmarks/pipeline_vs_torch.py --stream``, 4 alternated rounds) took
134.6 ms over the streams against 155.5 over gRPC (0.865; by round 0.78-0.93), its CPU 223
against 260 ms.

- Each worker listens on its host (a port the system picks) and, in every epoch it trains
  in, writes its address under the deployment's store (``cfg.tp_store``) at
  ``ppstream/<replica>/<tp rank>/e<epoch>/<stage>`` (:meth:`PipeStream.ready`, called before
  the step's first send or receive, so that a neighbour never waits for it).
- A send goes to a thread of its own per neighbour and epoch: it connects at the epoch's
  first frame (the address awaited in the store), says the deployment's token first, then
  writes length-prefixed frames in order; :meth:`PipeStream.flush` waits until every frame is
  written, looking every 50 ms whether the step was abandoned or ran out of time.
- A thread per connection reads: a hello without the token, a frame over the message limit
  (before it is read) and a frame ``Push`` would refuse (``deliver``: the same decode, check
  and inbox) close the connection. Frames land in the inbox, where the stage waits for them as
  for gRPC's, so the receiving side needs nothing else; a frame of an older epoch is refused
  there (fenced), as over gRPC.
- A failed send fails the step and closes the streams; the next send connects again (in the
  recovery's new epoch, to the address a replacement published there).
- Where the worker holds a certificate (``dmsc up`` gives every worker one) the streams are
  mutual TLS as its gRPC is: each end presents its leaf and trusts the deployment's authority
  only (:func:`tls_contexts`); the token hello goes inside.
- The same listener answers connections of calls (their own hello): the control plane's
  ``RunStep`` and ``RunWith`` and the previous stage's ``Relay``, where the worker said so
  (:meth:`PipeStream.answer_calls`, :mod:`dmsc.runtime.transport.stream_calls`).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.frames import FrameSpec, check_frame
from dmsc.runtime.compute.inbox import Aborted
from dmsc.runtime.compute.pipe_group import PipeGroup, pipe_group_of
from dmsc.runtime.transport.stream_calls import CALL_MAGIC, Handler, publish, serve
from dmsc.runtime.transport.streams import dial, hello, read_exact, store_client, tls_contexts
from dmsc.runtime.transport.wire import Kind, encode

MAGIC = b"DMSCPIPE"  # a connection of pipeline frames
_LEN = struct.Struct("!Q")
HELLO_TIMEOUT_S = 5.0  # a connection that says nothing this long is closed
# connections read at once (a stage has one from each neighbour an epoch): past it a new one is
# closed at once, so that a client opening many cannot start a thread for each
MAX_CONNECTIONS = 64
HEADER_SLACK = 1 << 10  # a frame's wire header and shape, above its payload's limit
POLL_S = 0.05  # how often a wait looks whether its step was abandoned

log = logging.getLogger(__name__)


def pipe_of(
    cfg: WorkerConfig, frames: FrameSpec, deliver: Callable[[bytes], object], logger: Any = log
) -> PipeGroup | PipeStream | None:
    """How the worker ``cfg`` configures sends its pipeline frames inside its datacenter: a
    gloo group (:mod:`.pipe_group`, its frames checked against ``frames`` as ``Push`` checks
    them), streams (``deliver`` takes a received frame as ``Push`` does), or None (gRPC)."""
    group = pipe_group_of(cfg, functools.partial(check_frame, frames))
    return group or pipe_stream_of(cfg, deliver, logger)


def pipe_stream_of(
    cfg: WorkerConfig, deliver: Callable[[bytes], object], logger: Any = log
) -> PipeStream | None:
    """The pipeline streams of the worker ``cfg`` configures (None: its frames go over gRPC
    or the gloo group); ``deliver`` takes a received frame as ``Push`` takes one."""
    if not cfg.pp_stream or not cfg.tp_store:  # a single stage listens for calls
        return None
    return PipeStream(
        cfg.tp_store, cfg.stage, cfg.replica, cfg.tp_rank, cfg.recv_timeout_s, deliver,
        cfg.max_message_bytes, cfg.host, cfg.token, logger,
    )  # fmt: skip


class _Sender:
    """One neighbour's stream in one epoch: a thread that connects, then writes frames in
    the order given."""

    def __init__(self, connect: Callable[[], socket.socket]) -> None:
        self._todo: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None
        self.sock: socket.socket | None = None
        threading.Thread(target=self._main, args=(connect,), daemon=True, name="pp-send").start()

    def _main(self, connect: Callable[[], socket.socket]) -> None:
        try:
            self.sock = connect()
            while (frame := self._todo.get()) is not None:
                self.sock.sendall(_LEN.pack(len(frame)))
                self.sock.sendall(frame)
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
        except BaseException as exc:  # the waiting stage's to raise
            with self._cond:
                self.error = exc
                self._cond.notify_all()
        finally:
            if self.sock is not None:
                self.sock.close()

    def put(self, frame: bytes) -> None:
        with self._cond:
            self._pending += 1
        self._todo.put(frame)

    def written(self, timeout_s: float) -> bool:
        """Whether every frame given is written (or the stream failed), waiting at most
        ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending or self.error is not None, timeout_s
            )

    def close(self) -> None:
        self._todo.put(None)
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # a write in progress ends now


class PipeStream:
    """This worker's listener and its streams to the neighbouring stages of its replica's
    pipeline (same tp rank), per epoch."""

    def __init__(
        self,
        store_address: str,
        stage: int,
        replica: int,
        tp_rank: int,
        timeout_s: float,
        deliver: Callable[[bytes], object],
        max_bytes: int,
        host: str = "127.0.0.1",
        token: str | None = None,
        logger: Any = log,
    ) -> None:
        self.store_address = store_address
        self.stage = stage
        self.prefix = f"ppstream/{replica}/{tp_rank}"
        self.timeout_s = timeout_s
        self.deliver = deliver
        self.max_bytes = max_bytes
        self._hello = hello(token, MAGIC)
        self._call_hello = hello(token, CALL_MAGIC)
        # what answers a connection of calls once it said its hello (:meth:`answer_calls`;
        # none: this worker takes none)
        self.calls: dict[str, Handler] | None = None
        self._store: Any = None
        self.epoch: int | None = None
        self.dropped: str | None = None  # why the streams were last closed mid-epoch
        self._senders: dict[int, _Sender] = {}
        self.refused = 0  # connections closed for what they sent (or for too many)
        self.max_connections = MAX_CONNECTIONS
        self._open = 0  # connections being read
        # each connection being read: its socket, then its TLS wrapping (closed with the listener)
        self._reading: dict[int, list[socket.socket]] = {}
        self._open_lock = threading.Lock()
        self.log = logger
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="pp-accept").start()

    @property
    def active(self) -> bool:
        """Whether an epoch's streams are in use (their sends are for :meth:`flush`)."""
        return self.epoch is not None

    # -- receiving --------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._open_lock:
                full = self._open >= self.max_connections
                self._open += 0 if full else 1
            if full:
                self.refuse(f"a connection past the {self.max_connections} open")
                conn.close()
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True, name="pp-recv").start()

    def _read(self, conn: socket.socket) -> None:
        held = [conn]  # the socket, then its TLS wrapping (which owns the connection after)
        with self._open_lock:
            self._reading[id(held)] = held
        try:
            self._read_frames(conn, held)
        except OSError:  # the sender went away or timed out saying hello
            pass
        finally:
            held[-1].close()
            with self._open_lock:
                self._open -= 1
                del self._reading[id(held)]

    def _read_frames(self, conn: socket.socket, held: list[socket.socket]) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(HELLO_TIMEOUT_S)
        contexts = tls_contexts()
        if contexts is not None:
            try:
                conn = contexts[0].wrap_socket(conn, server_side=True)
            except ssl.SSLError as exc:
                self.refuse(f"a TLS handshake failed: {exc}")
                return
            held.append(conn)
        said = bytearray(len(self._hello))
        if not read_exact(conn, memoryview(said)):
            return
        calls = self.calls
        if calls is not None and hmac.compare_digest(bytes(said), self._call_hello):
            conn.settimeout(None)
            serve(conn, calls, self.refuse, self.log)
            return
        if not hmac.compare_digest(bytes(said), self._hello):
            self.refuse("a connection without the deployment's token")
            return
        conn.settimeout(None)
        head = bytearray(_LEN.size)
        while read_exact(conn, memoryview(head)):
            (n,) = _LEN.unpack(head)
            if n > self.max_bytes + HEADER_SLACK:
                self.refuse(f"a frame of {n} bytes, over the limit of {self.max_bytes}")
                return
            frame = bytearray(n)
            if not read_exact(conn, memoryview(frame)):
                return
            try:
                self.deliver(frame)  # type: ignore[arg-type]  # decode reads it as bytes
            except Exception as exc:  # refused as Push refuses it
                self.refuse(f"a frame refused: {exc}")
                return

    def refuse(self, why: str) -> None:
        self.refused += 1
        self.log.warning("pipeline stream closed: %s", why)

    # -- sending ----------------------------------------------------------------------------

    def _store_client(self) -> Any:
        return store_client(self.store_address, self.timeout_s)

    def ready(self, epoch: int, abandoned: Callable[[], bool], end: float) -> None:
        """This worker's address published for ``epoch`` (once; an older epoch's streams
        closed)."""
        del abandoned, end  # publishing is one store round trip
        if self.epoch == epoch:
            return
        self.drop(None)
        self.epoch, self.dropped = epoch, None
        if self._store is None:
            self._store = self._store_client()
        self._store.set(f"{self.prefix}/e{epoch}/{self.stage}", self.address)

    def _connect(self, to: int, epoch: int) -> socket.socket:
        # a client of its own: a wait for a neighbour's key must not hold the one `ready` uses
        store = self._store_client()
        at = store.get(f"{self.prefix}/e{epoch}/{to}").decode()
        return dial(at, self._hello, self.timeout_s)

    # -- calls (:mod:`dmsc.runtime.transport.stream_calls`) ---------------------------------

    def answer_calls(self, methods: dict[str, Handler], service: str) -> None:
        """Answer connections of calls with ``methods`` (their gRPC methods' handlers), and
        say so under the store for the worker whose gRPC address is ``service``: before it
        registers, so that whoever finds it there finds its listener too."""
        self.calls = methods
        publish(self.store_address, service, self.address, self.timeout_s)

    def send(self, to: int, kind: Kind, step: int, mb: int, t: torch.Tensor) -> int:
        """Start sending ``t`` (on the host) to stage ``to``; the frame's bytes (booked as a
        ``Push`` of it is; the stream's 8 bytes of length are not counted)."""
        epoch = self.epoch
        assert epoch is not None
        frame = encode(kind, step, mb, t.detach(), epoch)
        sender = self._senders.get(to)
        if sender is None:
            sender = self._senders[to] = _Sender(lambda: self._connect(to, epoch))
        sender.put(frame)
        return len(frame)

    def flush(self, abandoned: Callable[[], bool], end: float) -> None:
        """Wait until every frame started is written."""
        for to, sender in list(self._senders.items()):
            while not sender.written(POLL_S):
                if abandoned():
                    self.drop("the step was abandoned (a newer epoch)")
                    raise Aborted("a pipeline send: moved to a newer epoch")
                if time.monotonic() > end:
                    self.drop("a pipeline send timed out")
                    raise TimeoutError("a pipeline send: not written within the receive timeout")
            if sender.error is not None:
                why = f"the stream to stage {to} failed: {sender.error}"
                self.drop(why)
                raise RuntimeError(f"pipeline stream: {why}")

    def drop(self, why: str | None) -> None:
        """Close the streams (``why`` None: for a newer epoch's). A frame's way is its own
        connection's: unlike a gloo group's tags, nothing left in flight can pair with a later
        step's frame (the inbox keys each by kind, step and micro-batch, as ``Push``'s), so the
        next send of the same epoch connects again, as a ``Push`` after a failed one would."""
        senders, self._senders = self._senders, {}
        if why is not None:
            self.dropped = why
            self.log.warning("pipeline streams closed: %s", why)
        for sender in senders.values():
            sender.close()

    def close(self) -> None:
        """Close the streams, stop listening and close the connections being read."""
        self.drop(None)
        with contextlib.suppress(OSError):  # a thread in accept() holds it open otherwise
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._open_lock:
            reading = [held[-1] for held in self._reading.values()]
        for conn in reading:
            with contextlib.suppress(OSError):  # its reader's recv ends
                conn.shutdown(socket.SHUT_RDWR)
