"""A run of an inference session's next tokens drawn at its first stage (``Draw``,
:class:`dmsc.runtime.transport.drawing.Draw`): the control plane makes one call for the run
instead of one a token.

Each token is the inference step the control plane would have sent for it, chained through the
later stages by :mod:`.relay` (its ``RunStep``, run by the worker as one from the control plane
is), and the next token is drawn from the last stage's answer with :func:`.sampling.draw` and the
generator the control plane handed over (its state in the call, back in the answer): the tokens
are those that one call per token draws, token for token. What it saves is the control plane's
round trip a token (2.5 of 24.5 ms a token at two stages, benchmarks/inference.py, measured
inside the workers).

The run ends early, with the tokens drawn so far, when what is left of the step's budget would
not hold another token as long as the last one took: the control plane then has its tokens
before its own wait ends, and decides (its deadline passed, or the next run)."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

import torch

from dmsc.runtime.compute.relay import MARGIN_S
from dmsc.runtime.compute.sampling import draw, reply_logits
from dmsc.runtime.transport.drawing import Draw
from dmsc.runtime.transport.messages import RunStep

Step = Callable[[RunStep], dict[str, Any]]


def generator(rng: str | None, seed: int | None) -> torch.Generator:
    """The generator of a run: from the state ``rng`` (base64), else seeded with ``seed``."""
    g = torch.Generator()
    if rng is None:
        return g.manual_seed(seed or 0)
    g.set_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))
    return g


def state(g: torch.Generator) -> str:
    """``g``'s state in base64 (:func:`generator` takes it back)."""
    return base64.b64encode(g.get_state().numpy().tobytes()).decode()


def run(step: Step, m: Draw, vocab: int) -> dict[str, Any]:
    """Draw ``m.count`` tokens (fewer when the budget runs short) running each token's step
    with ``step`` (the worker's ``RunStep``); the answer: ``drawn`` and the generator's
    ``rng`` after them."""
    try:
        g = generator(m.rng, m.sampling.seed)
    except (ValueError, RuntimeError) as exc:  # not a state torch's CPU generator takes
        raise ValueError(f"Draw: rng: {exc}") from None
    s = m.step
    # what is left of the budget at each token, less the margin its answer needs to travel
    deadline = None if s.budget_s is None else time.monotonic() + s.budget_s - MARGIN_S
    drawn: list[int] = []
    took = 0.0
    for _ in range(m.count):
        t0 = time.monotonic()
        if deadline is not None and drawn and t0 + took >= deadline:
            break  # another token would not fit in what is left
        if deadline is not None:
            s = s.model_copy(update={"budget_s": max(deadline - t0, 1e-3)})
        token = draw(reply_logits(step(s), vocab)[0], m.sampling, g)
        drawn.append(token)
        took = time.monotonic() - t0
        assert s.tokens is not None  # a Draw's step carries its tokens
        s = s.model_copy(
            update={"step": s.step + 1, "start": s.start + len(s.tokens[0]), "tokens": [[token]]}
        )
    return {"drawn": drawn, "rng": state(g)}
