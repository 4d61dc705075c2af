"""Drawing the next token from a model's logits: temperature, top-k and nucleus (top-p)
filtering, the three settings generation APIs share (Holtzman et al., "The Curious Case of
Neural Text Degeneration", ICLR 2020, for top-p). Pure functions of a logits vector; and what
of the logits a draw needs from the last stage (:func:`shipped_top`), rebuilt from its answer by
:func:`reply_logits`."""

from __future__ import annotations

import base64
from typing import Any

import torch

from dmsc.runtime.transport.messages import Sampling


def token_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution the next token is drawn from (1-D, sums to 1). Temperature 0 puts all
    the mass on the most likely token; top-k keeps the ``top_k`` most likely; top-p keeps a
    token when the tokens more likely than it hold less than ``top_p`` of the probability (so
    the most likely always stays)."""
    z = logits.detach().to(torch.float64).reshape(-1)
    if s.temperature == 0:
        out = torch.zeros_like(z)
        out[int(torch.argmax(z))] = 1.0
        return out
    z = z / s.temperature
    if 0 < s.top_k < z.numel():
        keep = torch.topk(z, s.top_k).indices
        masked = torch.full_like(z, float("-inf"))
        masked[keep] = z[keep]
        z = masked
    probs = torch.softmax(z, -1)
    if s.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass of the more likely tokens
        dropped = order[before >= s.top_p]
        probs[dropped] = 0.0
        probs = probs / probs.sum()
    return probs


def draw(logits: torch.Tensor, s: Sampling, g: torch.Generator) -> int:
    """One token from :func:`token_probs` with ``g``."""
    probs = token_probs(logits, s)
    if s.temperature == 0:
        return int(torch.argmax(probs))
    return int(torch.multinomial(probs, 1, generator=g))


def shipped_top(s: Sampling, vocab: int) -> int | None:
    """How many of the largest logits :func:`draw` reads (None: all of them): the most likely
    token when greedy, the ``top_k`` most likely when filtering by top-k (top-p then only ever
    drops from those). A decoded token then carries k numbers from the last stage, not
    ``vocab``."""
    if s.temperature == 0:
        return 1
    return s.top_k if 0 < s.top_k < vocab else None


def reply_logits(reply: dict[str, Any], vocab: int) -> torch.Tensor:
    """The logits (rows x ``vocab``) of a last stage's inference answer (see
    :func:`dmsc.runtime.compute.executor.logits_reply`): whole, or with only the largest it
    sent and -inf elsewhere, which :func:`token_probs` turns into the same distribution (the
    tokens left out have no probability under top-k, nor the mass under greedy)."""
    shape = reply["logits_shape"]
    values = torch.frombuffer(bytearray(base64.b64decode(reply["logits"])), dtype=torch.float32)
    values = values.reshape(shape)
    if "logit_ids" not in reply:
        return values
    ids = torch.frombuffer(bytearray(base64.b64decode(reply["logit_ids"])), dtype=torch.int64)
    dense = torch.full((shape[0], vocab), float("-inf"))
    return dense.scatter_(1, ids.reshape(shape), values)
