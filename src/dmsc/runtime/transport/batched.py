"""``RunWith``: a training or evaluation step's call carrying the batch its stage starts from.

The first stage of a replica takes the step's tokens and the last its targets. Sent as ``Push``
frames, one per micro-batch, they were eight calls a step more from the control plane at four
micro-batches, each a gRPC round trip of about 1 ms of CPU on this 2-core machine
(``benchmarks/pipeline_vs_torch.py``), and the first stage began its first forward only once
its ``RunStep`` had come after them (6.3-6.9 ms after the step was called, 3.8-5.4 ms with the
``RunStep`` sent first; measured inside the workers). ``RunWith`` is the step and its data in
one request: the ``RunStep`` as JSON, then the replica's whole batch as one wire frame of each
kind the stage takes (tokens, targets, or both for a pipeline of one stage), which the worker
cuts into the step's micro-batches as a batch drawn from its own shard is cut.

A request is ``!I`` the JSON's length, the JSON, then for each frame ``!I`` its length and the
frame (:mod:`.wire`). :func:`unpack` refuses anything else naming what is wrong.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from dmsc.runtime.transport.messages import RunStep
from dmsc.runtime.transport.rpc import CONTROL_BYTES, BadRequest, parse
from dmsc.runtime.transport.wire import Kind, Message, WireError, decode

_LENGTH = struct.Struct("!I")
CARRIED = (Kind.TOKENS, Kind.TARGETS)  # the frames a step may carry, each once


def pack(m: RunStep, frames: Sequence[bytes]) -> bytes:
    """A ``RunWith`` request: the step ``m`` and its batch's encoded ``frames``."""
    head = m.model_dump_json(exclude_none=True).encode()
    parts = [_LENGTH.pack(len(head)), head]
    for frame in frames:
        parts += [_LENGTH.pack(len(frame)), frame]
    return b"".join(parts)


def unpack(data: bytes, max_bytes: int) -> tuple[RunStep, list[Message]]:
    """The step and the frames of a ``RunWith`` request. Refused (:class:`BadRequest`, or
    :class:`WireError` for a frame) when malformed, when the step is not a training or
    evaluation step on the batch it carries, or when a frame is not a whole batch of tokens or
    targets of that step and epoch with a sample for each micro-batch."""
    m, at = _step(data)
    frames: list[Message] = []
    while at < len(data):
        if len(data) - at < _LENGTH.size:
            raise BadRequest(f"RunWith: {len(data) - at} bytes left, too short for a length")
        (n,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        if n > len(data) - at:
            raise BadRequest(f"RunWith: a frame of {n} bytes with {len(data) - at} left")
        frames.append(_frame(m, decode(data[at : at + n], max_bytes), frames))
        at += n
    if not frames:
        raise BadRequest("RunWith: no frame (a step without data is a RunStep)")
    return m, frames


def step_head(data: bytes, method: str) -> tuple[RunStep, int]:
    """The ``RunStep`` a request of ``method`` begins with (its JSON's length, then the JSON),
    and where what follows it begins; refused (:class:`BadRequest`) naming what is wrong."""
    if len(data) < _LENGTH.size:
        raise BadRequest(f"{method}: {len(data)} bytes, too short for its header")
    (n,) = _LENGTH.unpack_from(data)
    if n > min(CONTROL_BYTES, len(data) - _LENGTH.size):
        raise BadRequest(f"{method}: a step of {n} bytes in a request of {len(data)}")
    return parse(RunStep, data[_LENGTH.size : _LENGTH.size + n]), _LENGTH.size + n


def _step(data: bytes) -> tuple[RunStep, int]:
    m, at = step_head(data, "RunWith")
    if not (m.train or m.eval) or m.local_batch is not None:
        raise BadRequest("RunWith: a training or evaluation step on the batch it carries")
    return m, at


def _frame(m: RunStep, frame: Message, before: Sequence[Message]) -> Message:
    if frame.kind not in CARRIED or any(f.kind == frame.kind for f in before):
        name = frame.kind.name.lower()
        raise WireError(f"RunWith: a frame of {name} (tokens, targets: once each)")
    if frame.step != m.step or frame.microbatch != 0:
        raise WireError(
            f"RunWith: a frame of step {frame.step} micro-batch {frame.microbatch}, not the "
            f"whole batch of step {m.step} (micro-batch 0)"
        )
    if m.epoch is not None and frame.epoch != m.epoch:
        raise WireError(f"RunWith: a frame of epoch {frame.epoch} in a step of epoch {m.epoch}")
    rows = frame.tensor.shape[0] if frame.tensor.dim() else 0
    if rows < m.microbatches:
        raise BadRequest(
            f"RunWith: {m.microbatches} micro-batches of a batch of {rows} "
            "(each micro-batch needs a sample at least)"
        )
    return frame
