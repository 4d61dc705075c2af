"""``Draw``: a run of an inference session's next tokens drawn at its first stage, one call for
the run instead of one call per token from the control plane
(:mod:`dmsc.runtime.compute.drawing` runs it). A control message like those of
:mod:`.messages`, with its limits from there; a module of its own because that one is at the
project's size limit."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from dmsc.runtime.transport.messages import MAX_INFER_TOKENS, Message, RunStep, Sampling

# the state of torch's CPU generator (Mersenne Twister: 5,056 bytes) in base64, with room
MAX_RNG_CHARS = 16_384


class Draw(Message):
    """Draw ``count`` tokens: the first is drawn from ``step`` (the inference step of the
    session's next positions), each later one from a step of the token before, each with
    ``sampling`` and the generator whose state is ``rng`` (None: seeded with the sampling's
    seed), as the control plane draws one token a call."""

    step: RunStep
    count: Annotated[int, Field(ge=1, le=MAX_INFER_TOKENS)]
    sampling: Sampling
    rng: Annotated[str, Field(max_length=MAX_RNG_CHARS)] | None = None

    @model_validator(mode="after")
    def _one_session_row(self) -> Draw:
        s = self.step
        if s.train or s.eval or s.session is None or s.tokens is None or len(s.tokens) != 1:
            raise ValueError("step: an inference step of one session's row of tokens")
        return self
