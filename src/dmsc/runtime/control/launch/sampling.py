"""Drawing the next token from a model's logits: temperature, top-k and nucleus (top-p)
filtering, the three settings generation APIs share (Holtzman et al., "The Curious Case of
Neural Text Degeneration", ICLR 2020, for top-p). Pure functions of a logits vector."""

from __future__ import annotations

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
