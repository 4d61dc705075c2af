"""The ``dmsc.Control`` service's method table: each RPC of :class:`~.plane.ControlPlane` with
its request model (:mod:`dmsc.runtime.transport.messages`, a bad field refused with
INVALID_ARGUMENT) and its reply model (:mod:`dmsc.runtime.transport.replies`, an answer that does
not fit never sent). :class:`~.client.ControlClient` is the other end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from typing import Any, Protocol

import grpc

from dmsc.runtime.control.replanning import Replannable, replan_now
from dmsc.runtime.control.tasks.infer_batch import Batches
from dmsc.runtime.transport.messages import (
    DownRequest,
    InferBatch,
    InferRequest,
    InjectRequest,
    ReplanRequest,
    StatusRequest,
    TrainRequest,
)
from dmsc.runtime.transport.replies import (
    DownReply,
    InferBatchReply,
    InferReply,
    InjectReply,
    ReplanReply,
    StatusReply,
    TrainReply,
    stream_item,
)
from dmsc.runtime.transport.rpc import message_handler, stream_handler, waiting_handler


class Serves(Replannable, Protocol):
    """What the service calls on the control plane (:class:`~.plane.ControlPlane`)."""

    batches: Batches

    def status(self, req: StatusRequest) -> dict[str, Any]: ...
    def train(self, req: TrainRequest, gone: threading.Event) -> dict[str, Any]: ...
    def infer(self, req: InferRequest) -> dict[str, Any]: ...
    def infer_stream(
        self, req: InferRequest, gone: threading.Event
    ) -> Iterator[dict[str, Any]]: ...
    def down(self, req: DownRequest) -> dict[str, Any]: ...
    def inject(self, req: InjectRequest) -> dict[str, Any]: ...


def control_methods(cp: Serves) -> dict[str, grpc.RpcMethodHandler]:
    """The handlers of ``dmsc.Control`` on ``cp`` (``Revoke`` is the daemon's: it holds the
    gateway's key cache)."""
    return {
        "Status": message_handler(StatusRequest, cp.status, reply=StatusReply),
        # waits for the task's end; the caller going away (Ctrl-C) cancels the task
        "Train": waiting_handler(TrainRequest, cp.train, reply=TrainReply),
        "Infer": message_handler(InferRequest, cp.infer, reply=InferReply),
        "InferStream": stream_handler(InferRequest, cp.infer_stream, reply=stream_item),
        # a batch queued as one task and waited for; the caller going away cancels it
        "InferBatch": waiting_handler(InferBatch, cp.batches.call, reply=InferBatchReply),
        "Down": message_handler(DownRequest, cp.down, reply=DownReply),
        "Inject": message_handler(InjectRequest, cp.inject, reply=InjectReply),
        "Replan": message_handler(ReplanRequest, partial(replan_now, cp), reply=ReplanReply),
    }
