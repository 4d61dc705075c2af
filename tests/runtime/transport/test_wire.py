from __future__ import annotations

import contextlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.runtime.transport import wire
from dmsc.runtime.transport.wire import Kind, WireError, decode, encode


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]
)
def test_round_trip(dtype: torch.dtype) -> None:
    t = (torch.randn(2, 3, 4) * 10).to(dtype)
    msg = decode(encode(Kind.ACTIVATION, 7, 3, t, epoch=5))
    assert (msg.kind, msg.step, msg.microbatch, msg.epoch) == (Kind.ACTIVATION, 7, 3, 5)
    assert msg.tensor.dtype == dtype and torch.equal(msg.tensor, t)


def test_scalar_and_empty() -> None:
    assert decode(encode(Kind.GRADIENT, 0, 0, torch.tensor(1.5))).tensor.item() == 1.5
    assert decode(encode(Kind.TOKENS, 0, 0, torch.zeros(0, 4))).tensor.shape == (0, 4)


def test_rejections() -> None:
    good = encode(Kind.ACTIVATION, 1, 0, torch.ones(4, 4))
    with pytest.raises(WireError, match="truncated header"):
        decode(good[:10])
    with pytest.raises(WireError, match="magic"):
        decode(b"XXXX" + good[4:])
    with pytest.raises(WireError, match="kind"):
        decode(good[:5] + bytes([99]) + good[6:])
    with pytest.raises(WireError, match="dtype"):
        decode(good[:6] + bytes([42]) + good[7:])
    with pytest.raises(WireError, match="payload is"):
        decode(good[:-4])
    with pytest.raises(WireError, match="exceeds"):
        decode(good, max_bytes=16)
    # A shape that does not match the payload.
    n = wire._HEAD.size
    bad_shape = good[:n] + struct.pack("!2I", 4, 5) + good[n + 8 :]
    with pytest.raises(WireError, match="does not match"):
        decode(bad_shape)
    with pytest.raises(WireError):
        encode(Kind.ACTIVATION, 0, 0, torch.ones(2, dtype=torch.complex64))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_never_crashes_on_garbage(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(data, max_bytes=1 << 16)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(0, 255))
def test_decoder_survives_corrupted_frames(position: int, value: int) -> None:
    frame = bytearray(encode(Kind.GRADIENT, 3, 1, torch.arange(6, dtype=torch.float32)))
    frame[position % len(frame)] = value
    try:
        msg = decode(bytes(frame))
    except WireError:
        return
    assert msg.tensor.numel() * msg.tensor.element_size() <= len(frame)
