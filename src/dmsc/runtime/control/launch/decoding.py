"""Decoding one request token by token through a pipeline's forward, with or without an
inference session (the stages' KV cache), within its deadline and its turns."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from dmsc.runtime.control.launch import failures
from dmsc.runtime.control.launch.sampling import draw
from dmsc.runtime.transport.messages import Sampling

# (step, token ids [1, T], seconds to wait, session or None, position of the first) -> the
# next-token logits of the last position
Forward = Callable[[int, torch.Tensor, float, str | None, int], torch.Tensor]
Turn = Callable[[float | None], contextlib.AbstractContextManager[None]]


class Cancelled(RuntimeError):
    """A request given up because another replica answered first."""


class DeadlineExceeded(Cancelled):
    """A request stopped at its deadline: it frees its replica instead of running on unseen."""


def decode(
    forward: Forward,
    seq: int,
    prompt: Sequence[int],
    tokens: int,
    sampling: Sampling,
    *,
    step_base: int = 1_000_000,
    cancel: threading.Event | None = None,
    deadline: float | None = None,
    turn: Turn | None = None,
    token_timeout_s: float = 120.0,
    on_token: Callable[[int], None] | None = None,
    session: str | None = None,
) -> list[int]:
    """``tokens`` ids drawn after ``prompt``. With a ``session`` the prompt runs once and each
    later token alone (the stages keep the keys and values); past ``seq`` positions the context
    slides and every token runs it whole, as it always does without a session."""
    g = torch.Generator().manual_seed(sampling.seed or 0)
    out, kept = list(prompt), 0  # kept: positions the session's caches hold
    for k in range(tokens):
        if cancel is not None and cancel.is_set():
            raise Cancelled("cancelled: another replica answered first")
        timeout_s = token_timeout_s
        if deadline is not None:
            timeout_s = min(timeout_s, deadline - time.monotonic())
            if timeout_s <= 0:
                raise DeadlineExceeded(f"deadline passed after {k} of {tokens} tokens")
        cached = session is not None and len(out) <= seq
        start = kept if cached else 0
        ctx = torch.tensor([out[start:] if cached else out[-seq:]], dtype=torch.int64)
        try:
            with turn(deadline) if turn is not None else contextlib.nullcontext():
                logits = forward(step_base + k, ctx, timeout_s, session if cached else None, start)
                kept = len(out)
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline passed after {k} of {tokens} tokens, waiting for a turn"
            ) from None
        except failures.WorkerFailure:
            # The request's own deadline cut the call short: the replica is not at fault.
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"deadline passed after {k} of {tokens} tokens") from None
            raise
        nxt = draw(logits, sampling, g)
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
    return out[len(prompt) :]
