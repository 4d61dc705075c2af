"""The tensor-parallel ranks of a deployment's stage replicas, past the first.

A replica planned with tp = N is N worker processes. Rank 0 is the replica's worker as the rest
of the control layer knows it (its key, its client, its recovery); ranks 1 .. N-1 are kept here,
and every call the deployment makes to a replica goes to all of its ranks at once
(:meth:`TensorRanks.fan`): each rank takes the same frames and runs the same step on its shard,
and the call is over when every rank answered (rank 0's reply stands for the replica's) or
failed as soon as one rank failed. The ranks of a replica meet in a process group through the
TCPStore hosted here (port 0: the system picks a free one; its address goes into each
:class:`~dmsc.runtime.compute.config.WorkerConfig`), and so do the replicas of a stage for their
data-parallel all-reduces (:mod:`dmsc.runtime.compute.dp_collective`) and the stages of a
pipeline in one datacenter for their sends (:mod:`dmsc.runtime.compute.pipe_group`): the store
is hosted whenever there are several ranks, several replicas or such a pipeline. Where a worker
published a stream listener there (a pipeline's stages in one datacenter), the clients made
here call its step methods on it (:meth:`TensorRanks.client`,
:mod:`dmsc.runtime.transport.stream_calls`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import grpc
import torch.distributed as dist
from pydantic import BaseModel

from dmsc.runtime.compute.comm_meter import group_exposed
from dmsc.runtime.control.launch.failures import Key, key_of
from dmsc.runtime.control.launch.launchers import Launcher, WorkerHandle
from dmsc.runtime.transport.messages import STAGE_SERVICE, Health
from dmsc.runtime.transport.rpc import Client
from dmsc.runtime.transport.stream_calls import StreamCalls


class GroupFuture:
    """The calls to every rank of a replica as one grpc-like future: done once every call is,
    or one failed; its result is the first (rank 0's) reply."""

    def __init__(self, futures: list[Any]) -> None:
        self.futures = futures

    def _failed(self) -> BaseException | None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()  # type: ignore[no-any-return]
        return None

    def done(self) -> bool:
        return all(f.done() for f in self.futures) or self._failed() is not None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        failed = self._failed()
        if failed is not None:
            return failed
        for f in self.futures:
            exc = f.exception(timeout)
            if exc is not None:
                return exc  # type: ignore[no-any-return]
        return None

    def result(self, timeout: float | None = None) -> Any:
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.futures[0].result()

    def reply(self) -> Any:
        """Rank 0's JSON reply, read; a training step's with its tensor-parallel time the
        group's exposed one, from every rank's calls (:func:`ranks_comm`)."""
        first = json.loads(self.result())
        if isinstance(first, dict) and isinstance(first.get("comm"), dict):
            replies = [first, *(json.loads(f.result()) for f in self.futures[1:])]
            return first | {"comm": ranks_comm(replies)}
        return first

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        for f in self.futures:
            f.add_done_callback(lambda _: fn(self))

    def cancel(self) -> bool:
        return all([f.cancel() for f in self.futures])


def ranks_comm(replies: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The step figures by mode of a replica's ranks as one: rank 0's, with its tensor-parallel
    time the group's exposed one (:func:`~dmsc.runtime.compute.comm_meter.group_exposed`). Its
    other modes keep their calls' walls: the expert-parallel all-to-alls are put together over
    the replicas (:meth:`~dmsc.runtime.control.launch.deployment.Deployment.train_step`)."""
    comm = replies[0]["comm"]
    out = {m: dict(f) for m, f in comm.items()}
    if "tp" in comm:
        out["tp"] = group_exposed([r.get("comm", {}).get("tp", {}) for r in replies])
    return out


class TensorRanks:
    """Ranks 1 .. tp-1 of every replica (none at tp = 1) and the store their groups (and the
    replicas' data-parallel groups) meet at."""

    def __init__(
        self,
        tp: int,
        host: str = "127.0.0.1",
        replicas: int = 1,
        pipelines: bool = False,
        token: str | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be at least 1, not {tp}")
        self.tp = tp
        self.store: Any = None  # a TCPStore (torch's stubs do not export the name)
        self.address = ""
        if tp > 1 or replicas > 1 or pipelines:
            self.store = dist.TCPStore(  # type: ignore[attr-defined]
                host, 0, is_master=True, wait_for_workers=False
            )
            self.address = f"{host}:{self.store.port}"
        self.token = token
        # the step calls on the workers' stream listeners, where they published them here
        self.calls = StreamCalls(self.address, token) if self.address else None
        self.handles: list[WorkerHandle] = []
        self.clients: dict[Key, list[Client]] = {}
        self.by_sid: dict[str, Client] = {}

    def adopt(self, h: WorkerHandle, token: str | None) -> None:
        """Serve through ``h``, a rank past the first of its replica."""
        self.handles.append(h)
        self.handles.sort(key=lambda x: (key_of(x), x.config.tp_rank))
        client = self.client(h.address, token)
        self.clients.setdefault(key_of(h), []).append(client)
        self.by_sid[h.config.sid] = client

    def client(self, address: str, token: str | None) -> Client:
        """A client of the stage worker at ``address``: its step calls on its stream, where it
        has one (:mod:`dmsc.runtime.transport.stream_calls`), the others over gRPC."""
        via = self.calls.route(address) if self.calls is not None else None
        return Client(address, STAGE_SERVICE, token=token, via=via)

    def drop(self, key: Key) -> list[WorkerHandle]:
        """Forget the ranks of the replica at ``key`` (being replaced); their handles."""
        gone = [h for h in self.handles if key_of(h) == key]
        self.handles = [h for h in self.handles if key_of(h) != key]
        for h in gone:
            self.by_sid.pop(h.config.sid, None)
        for c in self.clients.pop(key, []):
            c.close()
        return gone

    def probe(self, timeout_s: float) -> tuple[dict[str, dict[str, Any]], set[str]]:
        """Health asked of every rank at once: what each that answered within ``timeout_s``
        said (its telemetry among it; ``{}`` for an answer that is not JSON), and the SIDs of
        those that did not answer. A recovery may drop or adopt ranks meanwhile (``dmsc status``
        runs on the control plane's request threads): the ranks asked are those of a copy taken
        first, and one whose channel a drop closed counts as silent."""
        futures, silent = {}, set()
        for sid, c in list(self.by_sid.items()):
            try:
                futures[sid] = c.send_future("Health", Health(), timeout_s)
            except ValueError:  # grpc's "Channel closed!": dropped by a recovery
                silent.add(sid)
        answers: dict[str, dict[str, Any]] = {}
        for sid, fut in futures.items():
            try:
                reply = fut.result()
            except grpc.RpcError:
                silent.add(sid)
                continue
            try:  # read, not trusted: only the telemetry's readers care what it says
                answers[sid] = json.loads(reply)
            except ValueError:
                answers[sid] = {}
        return answers, silent

    def fan(self, key: Key, leader: Client, call: Callable[[Client], Any]) -> Any:
        """``call`` on every rank of the replica at ``key`` (``leader``: rank 0's client); its
        future (one :class:`GroupFuture` for several ranks)."""
        others = self.clients.get(key, [])
        first = call(leader)
        return GroupFuture([first, *(call(c) for c in others)]) if others else first

    def send(self, key: Key, leader: Client, method: str, m: BaseModel, timeout_s: float) -> Any:
        """Send the message ``m`` to every rank of the replica at ``key``; its future."""
        return self.fan(key, leader, lambda c: c.send_pooled(method, m, timeout_s))

    def stop(self, launcher: Launcher) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):
                launcher.stop(h)
        for clients in self.clients.values():
            for c in clients:
                c.close()
        if self.calls is not None:
            self.calls.close()
        self.store = None
