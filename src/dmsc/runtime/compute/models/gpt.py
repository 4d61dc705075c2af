"""gpt-mini in PyTorch, as a chain of layers that any contiguous slice of can run as a stage.

The chain is ``embedding, block_0 .. block_{L-1}, head``, the same names the cost model and the
plan use. Every process builds the whole chain from the same seed and keeps its slice, so the
stages of a pipeline hold exactly the parameters single-process training would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmsc.spec import TransformerSpec


class Embedding(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.shape[1]
        pos_T = torch.arange(T, device=idx_BT.device)
        return self.tok(idx_BT) + self.pos(pos_T)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GeLU MLP."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        B, T, H = x_BTH.shape
        q, k, v = self.qkv(self.ln1(x_BTH)).split(H, dim=-1)
        q, k, v = (t.view(B, T, self.heads, H // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BTH = x_BTH + self.proj(att.transpose(1, 2).reshape(B, T, H))
        return x_BTH + self.fc2(F.gelu(self.fc1(self.ln2(x_BTH))))


class Head(nn.Module):
    """Final layer norm and the projection to the vocabulary."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x_BTH))


def layer_names(spec: TransformerSpec) -> list[str]:
    return ["embedding", *[f"block_{i}" for i in range(spec.layers)], "head"]


def build_chain(spec: TransformerSpec, seed: int) -> list[nn.Module]:
    """Every layer of the model, initialised from ``seed`` (the same in every process)."""
    if spec.mlp != "gelu" or spec.is_moe or spec.kv_heads_count != spec.heads or spec.dropout:
        raise ValueError(
            "the runtime model is a GPT (GeLU MLP, full attention, no experts, no dropout)"
        )
    torch.manual_seed(seed)
    chain: list[nn.Module] = [Embedding(spec.vocab, spec.hidden, spec.seq)]
    chain += [Block(spec.hidden, spec.heads, spec.ffn_size) for _ in range(spec.layers)]
    chain.append(Head(spec.hidden, spec.vocab))
    return chain


class StageModule(nn.Module):
    """A contiguous slice of the chain: a micro-model."""

    def __init__(self, layers: list[nn.Module], names: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.names = names

    @property
    def is_first(self) -> bool:
        return self.names[0] == "embedding"

    @property
    def is_last(self) -> bool:
        return self.names[-1] == "head"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_stage(spec: TransformerSpec, seed: int, first: str, last: str) -> StageModule:
    """The layers ``first`` .. ``last`` (inclusive, by name) of the model built from ``seed``."""
    names = layer_names(spec)
    if first not in names or last not in names:
        raise ValueError(f"unknown layer {first!r} or {last!r} (layers: {names[0]} .. {names[-1]})")
    lo, hi = names.index(first), names.index(last) + 1
    if lo >= hi:
        raise ValueError(f"empty layer range {first} .. {last}")
    chain = build_chain(spec, seed)
    return StageModule(chain[lo:hi], names[lo:hi])


def loss_fn(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))
