"""The typed client of the control plane's ``dmsc.Control`` service: one method per RPC, each
taking its request message (:mod:`dmsc.runtime.transport.messages`) and returning its reply model
(:mod:`dmsc.runtime.transport.replies`). The CLI talks to a running control plane only through
it (:meth:`ControlClient.connect` finds the one ``dmsc up`` started on a data directory).

A reply that does not fit its model raises :class:`~dmsc.runtime.transport.replies.BadReply`
naming the field; a refused request raises ``grpc.RpcError`` with the server's reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dmsc.runtime.transport import processes
from dmsc.runtime.transport.authority import Leaf
from dmsc.runtime.transport.log_calls import LogsReply, LogsRequest
from dmsc.runtime.transport.messages import (
    CONTROL_SERVICE,
    DownRequest,
    InferRequest,
    InjectRequest,
    ReplanRequest,
    RevokeRequest,
    StatusRequest,
    TrainRequest,
)
from dmsc.runtime.transport.replies import (
    DownReply,
    InferEnd,
    InferPiece,
    InferReply,
    InjectReply,
    ReplanReply,
    RevokeReply,
    StatusReply,
    TrainReply,
    parse_reply,
    stream_item,
)
from dmsc.runtime.transport.rpc import Client
from dmsc.spec import SpecError

# A call may wait for a whole training task (Train answers when the task ends).
CALL_TIMEOUT_S = 3600.0


class PendingTrain:
    """A ``Train`` call in flight: :meth:`done` without waiting, :meth:`result` the reply."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def done(self) -> bool:
        return bool(self._future.done())

    def result(self) -> TrainReply:
        return parse_reply(TrainReply, self._future.result())

    def cancel(self) -> None:
        """Cancel the call: the control plane cancels its task (it sees the caller go)."""
        self._future.cancel()


class InferStream:
    """An ``InferStream`` call: iterate for the pieces of text and then the end
    (:class:`InferEnd`); :meth:`cancel` stops the workers at their next token."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[InferPiece | InferEnd]:
        for item in self._call:
            yield stream_item(item)

    def cancel(self) -> None:
        self._call.cancel()


class ControlClient:
    """Calls the ``dmsc.Control`` service at one address."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
        leaf: Leaf | None = None,
    ):
        """``leaf``: the certificate to call with (mutual TLS; None: plain gRPC)."""
        self.address = address
        self.rpc = Client(address, CONTROL_SERVICE, timeout_s=timeout_s, token=token, leaf=leaf)

    @classmethod
    def connect(cls, control_file: Path | None = None) -> ControlClient:
        """The client of the control plane running on this data directory (its
        ``control.json``); a :class:`~dmsc.spec.SpecError` says why there is none."""
        from dmsc.data.db import control_file as default_file

        path = control_file if control_file is not None else default_file()
        if not path.exists():
            why = "not running (start it with `dmsc up --plan FILE`)"
            raise SpecError("control plane", "", why)
        try:
            info = json.loads(path.read_text())
            address, pid = str(info["address"]), int(info["pid"])
        except (ValueError, KeyError, TypeError):
            why = "unreadable; remove it if no control plane runs"
            raise SpecError(str(path), "", why) from None
        if not processes.alive(pid):  # killed without cleaning up: its run resumes at the next up
            raise SpecError(
                "control plane",
                "",
                f"not running (pid {pid} is gone without a clean stop; "
                "`dmsc up --plan FILE` with the same plan resumes its run)",
            )
        leaf = Leaf.from_wire(info["tls"]) if isinstance(info.get("tls"), dict) else None
        return cls(address, token=info.get("token"), leaf=leaf)

    def status(self) -> StatusReply:
        return self.rpc.ask("Status", StatusRequest(), StatusReply)

    def train(self, req: TrainRequest) -> TrainReply:
        """Run a training task; answers when it ends."""
        return self.rpc.ask("Train", req, TrainReply)

    def train_future(self, req: TrainRequest) -> PendingTrain:
        """Send a training task without waiting for its end."""
        return PendingTrain(self.rpc.send_future("Train", req))

    def infer(self, req: InferRequest) -> InferReply:
        return self.rpc.ask("Infer", req, InferReply)

    def infer_stream(self, req: InferRequest) -> InferStream:
        return InferStream(self.rpc.stream("InferStream", req))

    def inject(self, req: InjectRequest) -> InjectReply:
        return self.rpc.ask("Inject", req, InjectReply)

    def replan(self, req: ReplanRequest) -> ReplanReply:
        return self.rpc.ask("Replan", req, ReplanReply)

    def revoke(self, req: RevokeRequest, timeout_s: float | None = None) -> RevokeReply:
        return self.rpc.ask("Revoke", req, RevokeReply, timeout_s)

    def logs(self, req: LogsRequest, timeout_s: float | None = 30.0) -> LogsReply:
        return self.rpc.ask("Logs", req, LogsReply, timeout_s)

    def down(self) -> DownReply:
        return self.rpc.ask("Down", DownRequest(), DownReply)

    def close(self) -> None:
        self.rpc.close()
