"""The checks every codec of :mod:`.compression` and :class:`.powersgd.PowerSGD` puts a vector
and a payload through: a vector to encode is a finite 1-D float32 of the agreed length (refused
with ValueError, before any error-feedback state is touched); a payload to decode has the
agreed dtype, shape and length, and finite values (refused with :class:`CodecError`, never
IndexError or RuntimeError: a peer controls it)."""

from __future__ import annotations

import torch

from dmsc.runtime.compute.frames import finite


class CodecError(ValueError):
    """A payload that does not decode: truncated, mistyped, misconfigured or built to harm."""


def check_input(x: torch.Tensor, n: int, who: str) -> torch.Tensor:
    if x.dim() != 1 or x.dtype != torch.float32 or x.numel() != n:
        raise ValueError(
            f"{who}: expected a 1-D float32 vector of {n} elements, "
            f"got shape {tuple(x.shape)} {x.dtype}"
        )
    if not finite(x):
        raise ValueError(f"{who}: the vector has NaN or infinite entries")
    return x.detach()


def check_payload(payload: object, dtype: torch.dtype, who: str) -> torch.Tensor:
    if not isinstance(payload, torch.Tensor):
        raise CodecError(f"{who}: the payload is a {type(payload).__name__}, not a tensor")
    if payload.dtype != dtype:
        raise CodecError(f"{who}: expected a {dtype} payload, got {payload.dtype}")
    if payload.dim() != 1:
        raise CodecError(f"{who}: expected a 1-D payload, got shape {tuple(payload.shape)}")
    return payload.contiguous()


def check_length(payload: torch.Tensor, want: int, who: str, unit: str = "elements") -> None:
    if payload.numel() != want:
        raise CodecError(f"{who}: the payload has {payload.numel()} {unit}, expected {want}")


def check_finite(t: torch.Tensor, who: str, what: str) -> None:
    if not finite(t):
        raise CodecError(f"{who}: {what} hold NaN or infinite entries")
