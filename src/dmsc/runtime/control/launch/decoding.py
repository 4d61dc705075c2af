"""Decoding one request token by token through a pipeline's forward, with or without an
inference session (the stages' KV cache), within its deadline and its turns.

With ``runs`` (a call that draws several tokens at the first stage, ``Draw``:
:mod:`dmsc.runtime.compute.drawing`), a session's tokens after the first come in runs of one
call each, as many as take about :data:`RUN_S` at the last measured rate, whenever ``alone``
says no other request waits for the replica: a run is one turn, so requests that share a replica
still take turns a token each. The tokens are those drawn one a call (the same draw and
generator, handed over); what a run saves is the control plane's round trip a token."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from dmsc.runtime.compute.sampling import draw
from dmsc.runtime.control.launch import failures
from dmsc.runtime.transport.messages import Sampling

# (step, token ids [1, T], seconds to wait, session or None, position of the first) -> the
# next-token logits of the last position
Forward = Callable[[int, torch.Tensor, float, str | None, int], torch.Tensor]
Turn = Callable[[float | None], contextlib.AbstractContextManager[None]]
# (step, token ids [1, T], seconds to wait, session, position of the first, count, generator)
# -> the tokens drawn at the first stage (at least one), the generator moved past them
Runs = Callable[[int, torch.Tensor, float, str, int, int, torch.Generator], list[int]]

RUN_S = 0.25  # a run's length at most, at the last token's rate: a cancel waits for it
MAX_RUN = 64


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
    runs: Runs | None = None,
    alone: Callable[[], bool] | None = None,
) -> list[int]:
    """``tokens`` ids drawn after ``prompt``. With a ``session`` the prompt runs once and each
    later token alone (the stages keep the keys and values); past ``seq`` positions the context
    slides and every token runs it whole, as it always does without a session. With ``runs``,
    the session's tokens come in runs while ``alone()`` (called in the turn) holds."""
    g = torch.Generator().manual_seed(sampling.seed or 0)
    out, kept = list(prompt), 0  # kept: positions the session's caches hold
    per_token_s: float | None = None  # the last call's time a token
    while (k := len(out) - len(prompt)) < tokens:
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
        new: list[int] = []
        try:
            with turn(deadline) if turn is not None else contextlib.nullcontext():
                count = 1  # the first token alone: the prompt's step, and the rate to go by
                if runs is not None and cached:
                    count = _run_length(per_token_s, alone, min(tokens - k, seq - len(out) + 1))
                t0 = time.monotonic()
                if count > 1 and runs is not None and session is not None:
                    wait_s = token_timeout_s + 2 * (count - 1) * (per_token_s or 0.0)
                    if deadline is not None:
                        wait_s = min(wait_s, deadline - t0)
                    new = runs(step_base + k, ctx, wait_s, session, start, count, g)
                else:
                    logits = forward(
                        step_base + k, ctx, timeout_s, session if cached else None, start
                    )
                per_token_s = (time.monotonic() - t0) / max(len(new), 1)
                kept = len(out) + max(len(new), 1) - 1
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline passed after {k} of {tokens} tokens, waiting for a turn"
            ) from None
        except failures.WorkerFailure:
            # The request's own deadline cut the call short: the replica is not at fault.
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"deadline passed after {k} of {tokens} tokens") from None
            raise
        for nxt in new or [draw(logits, sampling, g)]:
            out.append(nxt)
            if on_token is not None:
                on_token(nxt)
    return out[len(prompt) :]


def _run_length(per_token_s: float | None, alone: Callable[[], bool] | None, most: int) -> int:
    """How many tokens the next call draws: a run of about :data:`RUN_S` at the last call's
    rate (``most`` at most: the tokens left, the positions the session's caches can take), or
    one when no rate is known yet or another request waits for the replica."""
    if not per_token_s or (alone is not None and not alone()):
        return 1
    return max(1, min(MAX_RUN, most, int(RUN_S / per_token_s)))
