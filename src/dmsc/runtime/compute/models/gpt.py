"""The GPT family in PyTorch (LayerNorm, learned positions, GeLU MLP, biases): gpt-mini and
GPT-2 checkpoints. Parameter names are the runtime's; :mod:`.hf` maps them to GPT-2's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmsc.runtime.compute.models.attention import LayerKV, causal_attention
from dmsc.spec import TransformerSpec


class Embedding(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.positions, spec.hidden)

    def forward(self, idx_BT: torch.Tensor, start: int = 0) -> torch.Tensor:
        T = idx_BT.shape[1]
        pos_T = torch.arange(start, start + T, device=idx_BT.device)
        return self.tok(idx_BT) + self.pos(pos_T)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GeLU MLP."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        hidden, eps = spec.hidden, spec.norm_eps
        self.head_dim = hidden // spec.heads
        self.approximate = spec.gelu_approximate
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, spec.ffn_size)
        self.fc2 = nn.Linear(spec.ffn_size, hidden)

    def forward(
        self, x_BTH: torch.Tensor, kv: LayerKV | None = None, start: int = 0
    ) -> torch.Tensor:
        # q, k and v of this module's heads: all of them, or a tensor-parallel rank's share
        # (:mod:`..tensor_parallel` keeps each rank's q, k and v in that order)
        # the projection's rows: those of x, or under sequence parallelism
        # (:mod:`..sequence_parallel`) the whole sequence while x holds this rank's slice
        qkv = self.qkv(self.ln1(x_BTH))
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = causal_attention(q, k, v, kv)
        x_BTH = x_BTH + self.proj(att.transpose(1, 2).reshape(B, T, -1))
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x_BTH)), approximate=self.approximate))
        return x_BTH + mlp


class Head(nn.Module):
    """Final layer norm and the projection to the vocabulary."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x_BTH))
