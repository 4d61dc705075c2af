"""The Llama family in PyTorch: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
and Mixtral's top-k mixture of experts in place of the MLP.

Each module computes what ``transformers``' Llama / Qwen2 / Mixtral code computes (tests compare
logits), with the runtime's parameter names; :mod:`.hf` maps them to the checkpoints'.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dmsc.runtime.compute.models.attention import LayerKV, causal_attention
from dmsc.spec import TransformerSpec
from dmsc.spec.model import RopeScaling


def rotary_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Angular frequency of each pair of rotated channels (RoFormer, Su et al. 2021), with Llama
    3's scaling of the long wavelengths (Meta's reference implementation, ``apply_scaling``)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = scaling.original_max_positions / scaling.low_freq_factor
    high_wavelen = scaling.original_max_positions / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_positions / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    between = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, between, scaled)


class Rotary(nn.Module):
    """cos and sin of every position's rotation, computed on first use on the input's device (no
    buffer: a stage built on the meta device and then loaded has nothing to re-initialise).

    One table per device of the positions seen so far (grown by doubling), sliced per call: a
    decoding step computed its position's row anew in every layer, 16 small ops a token
    (torch.profiler on benchmarks/inference.py). A row is the same elementwise cos and sin of
    the same products, so the slice equals what one position's computation gave, bit for bit."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = spec.head_dim, spec.rope_theta, spec.rope_scaling
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self, start: int, T: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + T
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < end:
            n = max(end, 64, 2 * (0 if table is None else table[0].shape[0]))
            inv = rotary_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
            freqs = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            table = self._tables[device] = (emb.cos(), emb.sin())
        cos, sin = table
        return cos[start:end], sin[start:end]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of ``x`` (B, heads, T, d): the half-split layout of the
    Hugging Face Llama checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with ``kv_heads`` key/value heads shared by groups of query heads."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads_count, d
        self.q = nn.Linear(h, self.heads * d, bias=spec.qkv_bias)
        self.k = nn.Linear(h, self.kv_heads * d, bias=spec.qkv_bias)
        self.v = nn.Linear(h, self.kv_heads * d, bias=spec.qkv_bias)
        self.o = nn.Linear(self.heads * d, h, bias=False)
        self.rotary = Rotary(spec)

    def forward(
        self, x_BTH: torch.Tensor, kv: LayerKV | None = None, start: int = 0
    ) -> torch.Tensor:
        B, T, _ = x_BTH.shape
        d = self.head_dim
        q = self.q(x_BTH).view(B, T, self.heads, d).transpose(1, 2)
        k = self.k(x_BTH).view(B, T, self.kv_heads, d).transpose(1, 2)
        v = self.v(x_BTH).view(B, T, self.kv_heads, d).transpose(1, 2)
        cos, sin = self.rotary(start, T, x_BTH.device)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        att = causal_attention(q, k, v, kv, gqa=self.kv_heads != self.heads)
        return self.o(att.transpose(1, 2).reshape(B, T, self.heads * d))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer, "GLU Variants Improve Transformer", 2020)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MixtureOfExperts(nn.Module):
    """Mixtral's sparse MLP (Jiang et al. 2024, sec. 2.1): a linear router scores the experts, each
    token goes to its ``top_k``, weighted by their softmax probabilities renormalised over the
    chosen ones."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(spec.hidden, spec.ffn_size) for _ in range(spec.experts)
        )

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        flat = x_BTH.reshape(-1, x_BTH.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weight[rows, slot, None])
        return out.view_as(x_BTH)


class TokenEmbedding(nn.Module):
    """Token embeddings only: positions enter through the rotary attention."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)

    def forward(self, idx_BT: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.tok(idx_BT)


class Block(nn.Module):
    """Pre-norm block: RMSNorm, attention, RMSNorm, SwiGLU (or the mixture of experts)."""

    def __init__(self, spec: TransformerSpec, moe: bool) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.attn = Attention(spec)
        self.ln2 = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.mlp: nn.Module = MixtureOfExperts(spec) if moe else SwiGLU(spec.hidden, spec.ffn_size)

    def forward(
        self, x_BTH: torch.Tensor, kv: LayerKV | None = None, start: int = 0
    ) -> torch.Tensor:
        x_BTH = x_BTH + self.attn(self.ln1(x_BTH), kv, start)
        return x_BTH + self.mlp(self.ln2(x_BTH))


class Head(nn.Module):
    """Final RMSNorm and the projection to the vocabulary."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x_BTH))
