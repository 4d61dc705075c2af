"""Causal attention over a growing key/value cache: what an inference session keeps per layer.

A session's first step (``start`` 0) runs the prompt and keeps every attention layer's keys and
values; each later step runs only the new tokens at positions ``start ..`` and attends to the
kept ones, so a token costs one position of compute instead of the whole context (as Petals'
inference sessions do)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class LayerKV:
    """One attention layer's keys and values, (batch, kv heads, positions, head dim): the first
    ``length`` positions of buffers grown by doubling. Appending a token's keys by concatenating
    copied the whole context every token (9% of a decoding token's time at 150 positions,
    torch.profiler on benchmarks/inference.py); written in place, a token copies its own."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    length: int = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept keys and values followed by ``k`` and ``v`` (kept from now on)."""
        k, v = k.detach(), v.detach()
        end = self.length + k.shape[2]
        if self.k is None or self.v is None or end > self.k.shape[2]:
            size = max(end, 64, 2 * (0 if self.k is None else self.k.shape[2]))
            grown_k = k.new_empty((*k.shape[:2], size, k.shape[3]))
            grown_v = v.new_empty((*v.shape[:2], size, v.shape[3]))
            if self.k is not None and self.v is not None:
                grown_k[:, :, : self.length] = self.k[:, :, : self.length]
                grown_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    @property
    def nbytes(self) -> int:
        """The memory its buffers hold (up to twice what the positions kept need)."""
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


# every SDPA backend but cuDNN's, in torch's own order of preference among them
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def inference_attention(device: torch.device) -> Iterator[None]:
    """Attention for an inference step on ``device``: on CUDA, any SDPA backend but cuDNN's.

    torch picks cuDNN's attention first on Hopper, and cuDNN builds (on the host) an execution
    graph for each new shape it sees. A training step's shape is the same every step, so it
    pays once; an inference step's keys are one position longer every token, so each token paid
    a new graph in every layer: 1.75 ms of host time a layer, 42 of a 345M model's 58 ms a
    token on an H200 (``benchmarks/gpu_decode.py``, torch.profiler), where flash attention
    issues its kernel in microseconds. Entered once a step (the switch itself costs about
    12 us on the host), not once a layer."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(_NOT_CUDNN):
        yield
