"""Causal attention over a growing key/value cache: what an inference session keeps per layer.

A session's first step (``start`` 0) runs the prompt and keeps every attention layer's keys and
values; each later step runs only the new tokens at positions ``start ..`` and attends to the
kept ones, so a token costs one position of compute instead of the whole context (as Petals'
inference sessions do)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class LayerKV:
    """One attention layer's keys and values, (batch, kv heads, positions, head dim)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None and self.v is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k.detach(), v.detach()
        return k, v

    @property
    def nbytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.nbytes + self.v.nbytes


@dataclass
class StageCache:
    """A session's keys and values at one stage, by the layer's index in the stage."""

    layers: dict[int, LayerKV] = field(default_factory=dict)
    length: int = 0  # positions kept

    def layer(self, index: int) -> LayerKV:
        return self.layers.setdefault(index, LayerKV())

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self.layers.values())


@dataclass
class StageSession:
    """An inference session at a stage worker: its keys and values, and when it last ran."""

    cache: StageCache
    used: float


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV | None, gqa: bool = False
) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` (the new positions) over the kept and the new keys,
    each query seeing the positions up to its own."""
    if kv is not None:
        k, v = kv.extend(k, v)
    T, S = q.shape[-2], k.shape[-2]
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if T == 1:  # one new token sees every position
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # SDPA's is_causal aligns the mask top-left; the new positions are the last T of S.
    rows = torch.arange(S - T, S, device=q.device)[:, None]
    mask = torch.arange(S, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
