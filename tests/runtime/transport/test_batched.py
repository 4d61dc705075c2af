"""RunWith: a training or evaluation step's call with its batch, and every way it is refused."""

from __future__ import annotations

import pytest
import torch

from dmsc.runtime.transport import batched
from dmsc.runtime.transport.messages import RunStep
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.runtime.transport.wire import Kind, WireError, encode

STEP = RunStep(step=7, microbatches=2, epoch=3)
X = torch.arange(12).reshape(4, 3)
ACT = torch.ones(4, 2, 8)


def _frame(kind: Kind = Kind.TOKENS, step: int = 7, mb: int = 0, t: torch.Tensor = X) -> bytes:
    return encode(kind, step, mb, t, 3)


def test_a_step_carries_its_tokens_and_targets_whole() -> None:
    m, frames = batched.unpack(
        batched.pack(STEP, [_frame(), _frame(Kind.TARGETS, t=X + 1)]), 1 << 20
    )
    assert m == STEP
    assert [f.kind for f in frames] == [Kind.TOKENS, Kind.TARGETS]
    assert torch.equal(frames[0].tensor, X) and torch.equal(frames[1].tensor, X + 1)
    assert all(f.epoch == 3 and f.step == 7 and f.microbatch == 0 for f in frames)
    evaluated = STEP.model_copy(update={"train": False, "eval": True})
    assert batched.unpack(batched.pack(evaluated, [_frame()]), 1 << 20)[0] == evaluated


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x00\x00", "too short for its header"),
        (b"\x00\x00\x10\x00{}", "a step of 4096 bytes in a request of 6"),
        (batched.pack(STEP, []), "no frame"),
        (batched.pack(STEP, [b"junk"]), "truncated header"),
        (batched.pack(STEP, [_frame()]) + b"\x00", "too short for a length"),
        (batched.pack(STEP, [_frame()]) + b"\x00\x00\x01\x00", "a frame of 256 bytes with 0 left"),
        (batched.pack(STEP.model_copy(update={"train": False}), [_frame()]), "training or eval"),
        (batched.pack(STEP.model_copy(update={"local_batch": 4}), [_frame()]), "training or eval"),
        (batched.pack(STEP, [_frame(Kind.ACTIVATION, t=ACT)]), "a frame of activation"),
        (batched.pack(STEP, [_frame(), _frame()]), "a frame of tokens .tokens, targets: once each"),
        (batched.pack(STEP, [_frame(step=8)]), "a frame of step 8 micro-batch 0"),
        (batched.pack(STEP, [_frame(mb=1)]), "micro-batch 1, not the whole batch"),
        (batched.pack(STEP, [encode(Kind.TOKENS, 7, 0, X, 2)]), "a frame of epoch 2"),
        (batched.pack(STEP, [_frame(t=X[:1])]), "2 micro-batches of a batch of 1"),
    ],
)  # fmt: skip
def test_a_malformed_request_is_refused_saying_why(data: bytes, why: str) -> None:
    with pytest.raises((BadRequest, WireError), match=why):
        batched.unpack(data, 1 << 20)


def test_a_frame_over_the_worker_limit_is_refused() -> None:
    with pytest.raises(WireError, match="exceeds the limit"):
        batched.unpack(batched.pack(STEP, [_frame()]), 16)
