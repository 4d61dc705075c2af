"""Peer transport of a stage worker: where its neighbours are and the frames sent to them.

A worker sends its activations and gradients straight to the neighbouring stage's replica of the
same data-parallel rank (and gradients to and from its stage leader), as wire frames on
``Push``. Addresses come from the registry and are cached until a send fails or the worker moves
to a newer epoch. Sends do not block the schedule (like an ``isend``); :meth:`Peers.flush` waits
for them at the end of a step.

A peer may be replaced while a step runs (a recovery gives it a new address): a send to its old
address fails with UNAVAILABLE, and the frame goes again to the address the registry has now,
while the sender waits for its own frames (the peer may be waiting for exactly that frame before
it sends the one awaited here), or at the latest when the step flushes.

With a :class:`~.pipe_group.PipeGroup` (the stages of its replica in one datacenter, no shaped
link between them) and :attr:`Peers.direct` set (a training step), activations and gradients
go over that group's gloo point-to-point instead, or with a :class:`~.pipe_stream.PipeStream`
over a TCP stream to each neighbour, whose frames land in the inbox as ``Push``'s do; the bytes
are booked per peer the same way. With streams, a chained inference step's ``Relay`` to the next
stage is a call on that stage's listener too (:mod:`dmsc.runtime.transport.stream_calls`: the
clients of the peers are given the route, :attr:`Peers.calls`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch
from prometheus_client import Counter

from dmsc.runtime.compute.devices import HostStaging
from dmsc.runtime.compute.inbox import Aborted, Inbox
from dmsc.runtime.compute.pipe_group import CARRIED, PipeGroup
from dmsc.runtime.compute.pipe_stream import PipeStream
from dmsc.runtime.transport.messages import STAGE_SERVICE
from dmsc.runtime.transport.rpc import Client
from dmsc.runtime.transport.stream_calls import StreamCalls
from dmsc.runtime.transport.wire import Kind, encode

RESEND_AFTER_S = 0.5  # a receive this long without its frame checks for failed sends

PeerKey = tuple[int, int]  # (stage, replica)


class Peers:
    """The clients of this worker's peers and its sends in flight, at the inbox's epoch."""

    def __init__(
        self,
        registry: Client,
        inbox: Inbox,
        replica: int,
        recv_timeout_s: float,
        bytes_sent: Counter,
        token: str | None = None,
        device: torch.device | None = None,
        links: dict[int, Any] | None = None,
        tp_rank: int = 0,
        pipe: PipeGroup | PipeStream | None = None,
        tp: int = 1,
    ) -> None:
        self.registry = registry
        # tensors on a GPU leave and arrive through pinned host buffers
        self.staging = HostStaging(device or torch.device("cpu"))
        self.inbox = inbox
        self.replica = replica  # this worker's: the default peer of every stage
        self.tp_rank = tp_rank  # peers are the ranks of the same tensor-parallel rank
        self.tp = tp  # ranks of this stage: each sends its share of a frame (.pp_shards)
        self.recv_timeout_s = recv_timeout_s
        self.token = token
        self._bytes_sent = bytes_sent
        self._clients: dict[PeerKey, Client] = {}
        self._pending: list[tuple[PeerKey, bytes, Any]] = []
        self._detached: list[Any] = []  # sends nobody waits for
        self.deadline: float | None = None  # the step's own end (time.monotonic()), if any
        self._pinned: int | None = None  # the running step's epoch (at_epoch)
        self.sent: dict[PeerKey, int] = {}  # bytes pushed to each peer since the step began
        # thin links to neighbouring stages (a LinkShaper each, by stage): a send waits its turn
        self.links = links or {}
        self.pipe = pipe  # gloo group or streams, where the pipeline's stages share a datacenter
        self.direct = False  # this step's activations and gradients go through ``pipe``
        # calls to the other stages' streams (a Relay), where this worker has streams of its own
        self.calls: StreamCalls | None = None
        if isinstance(pipe, PipeStream):
            self.calls = StreamCalls(pipe.store_address, token, recv_timeout_s)

    @property
    def epoch(self) -> int:
        """The epoch of the frames this worker sends and waits for: its step's (see
        :meth:`at_epoch`), else the inbox's."""
        return self.inbox.epoch if self._pinned is None else self._pinned

    @contextlib.contextmanager
    def at_epoch(self, epoch: int | None) -> Iterator[None]:
        """A step's frames, sent and awaited, are of the epoch its call was made in (None: the
        inbox's now). An ``Abort`` that moves the worker on after the call's epoch was checked,
        but before its first wait, fails the step (:class:`Aborted`) instead of leaving it
        waiting for frames of the new epoch, which never come (a recovery waited the whole
        receive timeout, 60 s, for a step its orchestrator had given up)."""
        at = self.inbox.epoch if epoch is None else epoch
        if self.inbox.epoch != at:
            raise Aborted(f"moved to epoch {self.inbox.epoch} before the step of epoch {at} ran")
        self._pinned = at
        try:
            yield
        finally:
            self._pinned = None

    def _key(self, stage: int, replica: int | None) -> PeerKey:
        return (stage, self.replica if replica is None else replica)

    def client(self, stage: int, replica: int | None = None, refresh: bool = False) -> Client:
        """The client of ``stage``'s replica (ours by default), found in the registry."""
        key = self._key(stage, replica)
        if refresh or key not in self._clients:
            found = self.registry.call("Lookup", {"stage": stage, "kind": "stage"})["services"]
            mine = [
                s for s in found if s["replica"] == key[1] and s.get("tp_rank", 0) == self.tp_rank
            ]
            if not mine:
                raise RuntimeError(f"no live replica {key[1]} of stage {stage}")
            at = mine[0]["address"]
            via = self.calls.route(at) if self.calls is not None else None
            self._clients[key] = Client(at, STAGE_SERVICE, token=self.token, via=via)
        return self._clients[key]

    def forget(self) -> None:
        """Drop every cached address (after a move to a newer epoch: a replaced peer has a new
        one)."""
        self._clients = {}

    def send(
        self,
        stage: int,
        kind: Kind,
        step: int,
        mb: int,
        tensor: torch.Tensor,
        replica: int | None = None,
    ) -> None:
        """Send without blocking the schedule (like an isend); :meth:`flush` waits for all."""
        if self._direct(kind, replica):
            assert self.pipe is not None
            self.pipe.ready(self.epoch, self._abandoned(), self._end())
            n = self.pipe.send(stage, kind, step, mb, self.staging.to_host(tensor))
            self._bytes_sent.labels(kind.name.lower()).inc(n)
            key = self._key(stage, None)
            self.sent[key] = self.sent.get(key, 0) + n
            return
        frame = encode(kind, step, mb, self.staging.to_host(tensor), self.epoch)
        self._bytes_sent.labels(kind.name.lower()).inc(len(frame))
        link = self.links.get(stage)
        if link is not None:
            link.take(len(frame))
        self.push(self._key(stage, replica), frame)

    def _direct(self, kind: Kind, replica: int | None) -> bool:
        return self.direct and self.pipe is not None and kind in CARRIED and replica is None

    def _abandoned(self) -> Callable[[], bool]:
        epoch = self.epoch
        return lambda: self.inbox.epoch != epoch

    def _end(self) -> float:
        end = time.monotonic() + self.recv_timeout_s
        return end if self.deadline is None else min(end, self.deadline)

    def step_failed(self, why: str) -> None:
        """A step that used the pipeline group ended half-way: its frames in flight would
        pair up with the next step's, so the group of this epoch is dropped."""
        if self.direct and self.pipe is not None and self.pipe.active:
            self.pipe.drop(f"a step failed: {why}")

    def count(self, kind: Kind, nbytes: int) -> None:
        """Count a frame encoded elsewhere (a leader's answer to several replicas)."""
        self._bytes_sent.labels(kind.name.lower()).inc(nbytes)

    def push(self, key: PeerKey, frame: bytes) -> None:
        """Send an encoded frame to the peer at ``key``; :meth:`flush` waits for it."""
        self.sent[key] = self.sent.get(key, 0) + len(frame)
        self._pending.append((key, frame, self.client(*key).raw_pooled("Push", frame)))

    def push_detached(self, key: PeerKey, frame: bytes) -> None:
        """Send an encoded frame that nobody waits for (its peer may be stalled). The call is
        kept alive here: a grpc future that is garbage-collected is cancelled."""
        self.sent[key] = self.sent.get(key, 0) + len(frame)
        fut = self.client(*key).raw_pooled("Push", frame)
        self._detached = [f for f in self._detached if not f.done()] + [fut]

    def abandon(self) -> None:
        """Forget the sends in flight (those left by an abandoned step are not ours to finish)
        and start counting the bytes of a new step."""
        self._pending = []
        self.sent = {}

    def flush(self) -> None:
        """Wait for every send; a peer that moved is looked up again (once). Gives up with
        :class:`Aborted` as soon as the worker moves to a newer epoch (a stalled peer must not
        hold the survivors of a failure)."""
        if self.pipe is not None and self.pipe.active:
            self.pipe.flush(self._abandoned(), self._end())
        pending, self._pending = self._pending, []
        epoch = self.epoch
        for key, frame, fut in pending:
            while True:
                try:
                    fut.result(timeout=0.05)
                except grpc.FutureTimeoutError:
                    if self.epoch == epoch:
                        continue
                    fut.cancel()
                    raise Aborted("sends abandoned: moved to a newer epoch") from None
                except Exception:  # the peer moved or restarted: ask the registry again
                    self.client(*key, refresh=True).raw("Push", frame, timeout_s=10)
                break

    def recv(self, kind: Kind, step: int, mb: int, src: int | None = None) -> torch.Tensor:
        """Wait for a frame of this step (on this worker's device), sent by stage ``src``
        (needed for the pipeline group's frames). Meanwhile a send that failed because its
        peer is gone (replaced since it was looked up) goes again to the address the registry
        has now."""
        epoch = self.epoch
        end = self._end()  # nobody waits for the step past its deadline
        if src is not None and self._direct(kind, None):
            assert self.pipe is not None
            self.pipe.ready(epoch, self._abandoned(), end)  # a stream's: its address published
            if isinstance(self.pipe, PipeGroup):  # else the frame comes through the inbox
                got = self.pipe.recv(src, kind, step, mb, self._abandoned(), end)
                return self.staging.to_device(got)
        while True:
            left = end - time.monotonic()
            try:
                got = self.inbox.get(kind, step, mb, max(0.0, min(RESEND_AFTER_S, left)), epoch)
                return self.staging.to_device(got)
            except TimeoutError:
                if left <= RESEND_AFTER_S:
                    raise
                self._resend_failed()

    def _resend_failed(self) -> None:
        for n, (key, frame, fut) in enumerate(self._pending):
            if not fut.done() or fut.cancelled():
                continue
            exc = fut.exception()
            if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
                continue
            try:
                peer = self.client(*key, refresh=True)
            except Exception:  # no replacement registered yet: try again on the next round
                continue
            self._pending[n] = (key, frame, peer.raw_pooled("Push", frame))
