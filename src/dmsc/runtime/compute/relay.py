"""Chained inference steps: a stage hands its activations to the next stage itself and answers
with the last stage's reply, so that the orchestrator makes one call a token, not one a stage.

Decoding a token through ``p`` stages took ``p`` calls from the orchestrator (a ``RunStep`` to
every stage) and ``p - 1`` pushes of activations between the stages: ``2p - 1`` gRPC calls, most
of dmsc's CPU a token beyond the model's own once the last stage answered with the logits the
draw reads only (issue 31's profile: three calls, about 3.9 ms of 23 ms at two stages). Chained,
the orchestrator calls the first stage only; its ``RunStep`` names the later stages' epochs in
``relay``, and each stage but the last calls the next one's ``Relay`` with its activations in
the request (:func:`pack`: the onward ``RunStep`` and the activations' wire frame): ``p`` calls.
The last stage's reply (its logits) comes back up the chain as each call's answer, the way
training's pipeline frames go from stage to stage rather than through the orchestrator.

A stage waits for the next within its own budget less a margin (:func:`onward`), so that a stage
that does not answer is named by the one before it, whose answer reaches the orchestrator before
its own wait ends; the next stage's refusals keep their status (a full stage's
RESOURCE_EXHAUSTED, a bad request's INVALID_ARGUMENT, an abandoned step's ABORTED) and gain the
name of the stage that gave them. An interleaved pipeline is not chained (its chunks go back and
forth between the stages: the orchestrator calls every stage).

Where the two stages have pipeline streams (one datacenter, :mod:`.pipe_stream`) the ``Relay``
is a call on the next stage's listener (:mod:`dmsc.runtime.transport.stream_calls`, the route
of the peer's client), answered by the same handler with the same statuses; else a gRPC call.
"""

from __future__ import annotations

import json
import re
import struct
import time
from typing import Any

import grpc
import torch

from dmsc.runtime.compute.peers import Peers
from dmsc.runtime.transport.batched import step_head
from dmsc.runtime.transport.messages import RunStep
from dmsc.runtime.transport.rpc import Abandoned, BadRequest, NoRoom
from dmsc.runtime.transport.wire import Kind, Message, WireError, decode, encode

_UNCAUGHT = re.compile(r"^Exception calling application: ")  # how gRPC words a handler's raise
_LENGTH = struct.Struct("!I")  # the onward RunStep's JSON bytes, before the frame
# what each stage keeps of its wait for itself: its answer naming a silent next stage must reach
# its caller before the caller's own wait ends (a tenth of the wait when that is shorter)
MARGIN_S = 0.05


class RelayFailed(RuntimeError):
    """The next stage of a chained step failed (gone, or broken mid-call); names it."""


def pack(m: RunStep, frame: bytes) -> bytes:
    """A ``Relay`` request: the step the next stage runs and the wire frame of its input."""
    head = m.model_dump_json(exclude_none=True).encode()
    return _LENGTH.pack(len(head)) + head + frame


def unpack(data: bytes, max_bytes: int) -> tuple[RunStep, Message]:
    """The step and the activations' frame of a ``Relay`` request; a malformed one is refused
    (:class:`BadRequest`, or :class:`WireError` for its frame) naming what is wrong."""
    m, at = step_head(data, "Relay")
    if m.relay is None or m.tokens is not None:
        raise BadRequest("Relay: the step must be a chained inference step's (relay, no tokens)")
    frame = decode(data[at:], max_bytes)
    if frame.kind != Kind.ACTIVATION or frame.step != m.step or frame.microbatch != 0:
        raise WireError(
            f"Relay: a {frame.kind.name.lower()} frame of step {frame.step} micro-batch "
            f"{frame.microbatch}, not the activations of step {m.step} micro-batch 0"
        )
    return m, frame


def chained(m: RunStep, stage: int, stages: int, interleaved: bool) -> bool:
    """Whether ``stage`` (of ``stages``) hands step ``m``'s activations on itself; a ``relay``
    that does not name every later stage, or at an interleaved stage, is refused."""
    if m.relay is None:
        return False
    if len(m.relay) != stages - 1 - stage or interleaved:
        why = " (interleaved: not chained)" if interleaved else ""
        raise BadRequest(f"RunStep relay: {len(m.relay)} stages after stage {stage}{why}")
    return bool(m.relay)


def onward(m: RunStep, deadline: float | None, wait_s: float) -> tuple[RunStep, float]:
    """The step the next stage runs after ``m`` here, and how long to wait for its answer:
    until ``deadline`` (``time.monotonic()``; none: ``wait_s``) less the margin."""
    assert m.relay  # a chained step with a stage after this one
    left = wait_s if deadline is None else deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"step {m.step}: its budget ran out before the next stage's call")
    left -= min(MARGIN_S, left / 10)
    update = {"epoch": m.relay[0], "relay": m.relay[1:], "tokens": None, "budget_s": left}
    return m.model_copy(update=update), left


def packed_on(
    peers: Peers, stage: int, m: RunStep, y: torch.Tensor, deadline: float | None
) -> tuple[bytes, float]:
    """The ``Relay`` request that runs the rest of the chained step ``m`` (this ``stage``'s
    output ``y``) at the next stage, and how long to wait for its answer. Made while the worker
    still runs the step: ``y``'s host copy may be a staging buffer the next step writes, and
    several requests' tokens may be on their way through a stage at once."""
    step, wait_s = onward(m, deadline, peers.recv_timeout_s)
    assert step.epoch is not None
    frame = encode(Kind.ACTIVATION, m.step, 0, peers.staging.to_host(y), step.epoch)
    peers.count(Kind.ACTIVATION, len(frame))
    return pack(step, frame), wait_s


def hand_on(
    peers: Peers, stage: int, data: bytes, wait_s: float, deadline: float | None
) -> dict[str, Any]:
    """Send the ``Relay`` request ``data`` (:func:`packed_on`) to the next stage, the worker
    free meanwhile, and answer with its reply. A peer replaced since it was looked up is looked
    up again, once."""
    link = peers.links.get(stage + 1)
    if link is not None:  # a thin link to the next stage: the frame waits its turn
        link.take(len(data))
    where = f"stage {stage + 1} replica {peers.replica}"
    address = peers.client(stage + 1).address
    for again in (False, True):
        try:
            reply: dict[str, Any] = json.loads(peers.client(stage + 1).raw("Relay", data, wait_s))
            return reply
        except grpc.RpcError as exc:  # also a call's on a stream (its client's route)
            code, details = exc.code(), _UNCAUGHT.sub("", exc.details() or "")
            moved = code == grpc.StatusCode.UNAVAILABLE and not again and _moved(peers, stage + 1)
            if moved and (left := _left(deadline, wait_s)) > 0:
                wait_s, address = left, peers.client(stage + 1).address
                continue
            raise _status(code, f"{where} ({address}): {details}") from None
    raise AssertionError("unreachable")


def _moved(peers: Peers, stage: int) -> bool:
    """Whether the registry now has another address for ``stage`` (a replacement)."""
    old = peers.client(stage).address
    try:
        return peers.client(stage, refresh=True).address != old
    except RuntimeError:  # not registered (yet): nothing to call
        return False


def _left(deadline: float | None, wait_s: float) -> float:
    return wait_s if deadline is None else deadline - time.monotonic() - MARGIN_S


def _status(code: grpc.StatusCode, why: str) -> Exception:
    """The exception that answers this stage's caller with the next stage's status."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NoRoom(why)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return BadRequest(why)
    if code == grpc.StatusCode.ABORTED:
        return Abandoned(why)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(why)
    return RelayFailed(why)
