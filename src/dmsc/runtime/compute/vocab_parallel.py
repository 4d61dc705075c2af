"""The two ends of a tensor-parallel stage split over the vocabulary, Megatron-style (Shoeybi et
al., "Megatron-LM", 2019, sec. 3: "parallelize the input embedding weight matrix along the
vocabulary dimension" and fuse the output with the cross-entropy loss).

- The token embedding's rows are split over the ranks: rank r holds ids ``r V'/tp ..
  (r+1) V'/tp``, looks up the ids in its range (zeros for the others) and an all-reduce sums
  the ranks' rows (Megatron's ``g``; the backward passes the gradient through: each rank's rows
  get the gradient of the tokens in its range).
- The head's projection to the vocabulary is column-parallel over the vocabulary: its input
  enters through ``f`` (the identity forward, an all-reduce of the input's gradient backward)
  and each rank computes its share of the logits, ``[B, T, V'/tp]``.
- The loss is computed on the split logits (:func:`vocab_parallel_loss`): the maximum, the sum
  of exponentials and the target's logit are each all-reduced over the group, and the backward
  is the softmax gradient of the rank's share. No rank builds a ``[B, T, V]`` tensor in a
  training forward.
- A forward without a graph (decoding with the key/value cache, validation, serving's logits)
  all-gathers the logits over the vocabulary, so what leaves the stage is the whole model's
  ``[B, T, V]``, as at tp = 1.

The vocabulary is padded as Megatron-LM pads it (``make-vocab-size-divisible-by`` 128, times
tp) and as the cost model prices it (:func:`dmsc.netmodel.layers.padded_vocab`): ``V'`` rows, a
multiple of 128 tp (GPT-2's 50257 becomes 50432 at tp = 2; 256 stays 256), the padding
zeros in the embedding (never looked up: ids are below ``V``) and logits masked to ``-inf`` in
the head (probability 0, gradient 0, so the padding rows stay zero under AdamW). Checkpoints
stay in the tp = 1 form: :func:`shard_rows` pads then cuts, :func:`unshard_rows` joins then cuts
the padding off. Where the embedding and the head share one matrix (``tied_embeddings``) the two
shards are one parameter again (both split by rows the same way); where the two ends run in
different stages, each tp rank of the one swaps its shard's gradient with the same tp rank of
the other (:class:`~dmsc.runtime.compute.peers.Peers` pairs ranks by tp rank), which holds the
same rows.

PyTorch's ``torch.distributed.tensor.parallel.loss_parallel`` computes the same loss on a
``DTensor`` of logits sharded over the vocabulary; it is not used here for the reason the
blocks do not use ``ColwiseParallel`` (:mod:`.tensor_parallel`'s docstring, with the
measurement): the stage's parameters are plain tensors, which a ``DTensor`` head would have to
be wrapped into and out of. The loss here is checked against ``F.cross_entropy`` on the whole
logits (tests/runtime/compute/test_vocab_parallel.py, test_tensor_parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmsc.netmodel.layers import padded_vocab
from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.models.chain import StageModule, loss_fn
from dmsc.runtime.compute.tp_ops import Enter, Reduce, all_reduce

__all__ = [
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "shard_rows",
    "split_ends",
    "stage_loss",
    "unshard_rows",
    "vocab_parallel_loss",
]


def shard_rows(tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a whole ``[V, ...]`` ``tensor``, padded with zero rows to
    :func:`padded_vocab`'s ``V'`` first."""
    pad = padded_vocab(tensor.shape[0], tp) - tensor.shape[0]
    if pad:
        tensor = torch.cat([tensor, tensor.new_zeros((pad, *tensor.shape[1:]))])
    return tensor.chunk(tp, dim=0)[rank].contiguous()


def unshard_rows(parts: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """The whole ``[vocab, ...]`` tensor of the ranks' ``parts`` (rank order), padding dropped."""
    return torch.cat(parts, dim=0)[:vocab]


class _Rows:
    """The vocabulary range ``[lo, hi)`` a rank holds, and how much of it is real."""

    def __init__(self, vocab: int, group: dist.ProcessGroup | None) -> None:
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.vocab, self.group, self.tp = vocab, group, tp
        self.per = padded_vocab(vocab, tp) // tp
        self.lo = rank * self.per
        self.real = max(0, min(self.per, vocab - self.lo))  # the rest is padding


class VocabParallelEmbedding(nn.Module):
    """A token embedding's share of the vocabulary's rows; the ranks' lookups summed."""

    def __init__(self, full: nn.Embedding, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.rows = _Rows(full.num_embeddings, group)
        self.weight = nn.Parameter(
            shard_rows(full.weight.detach(), dist.get_rank(group), self.rows.tp)
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.rows.lo
        outside = (local < 0) | (local >= self.rows.per)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        out: torch.Tensor = Reduce.apply(x, self.rows.group)
        return out


class VocabParallelHead(nn.Module):
    """The projection to the vocabulary, column-parallel over it: each rank's share of the
    logits while training (for :func:`vocab_parallel_loss`), all of them gathered otherwise."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.rows = _Rows(full.out_features, group)
        self.weight = nn.Parameter(
            shard_rows(full.weight.detach(), dist.get_rank(group), self.rows.tp)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        logits = F.linear(Enter.apply(x, rows.group), self.weight)
        if rows.real < rows.per:  # padding columns: never the answer
            pad = torch.arange(rows.per, device=logits.device) >= rows.real
            logits = logits.masked_fill(pad, float("-inf"))
        if torch.is_grad_enabled():
            return logits
        parts = [torch.empty_like(logits) for _ in range(rows.tp)]
        with METER.timed("tp", (rows.tp - 1) * logits.numel() * logits.element_size()):
            dist.all_gather(parts, logits.contiguous(), group=rows.group)
        return torch.cat(parts, dim=-1)[..., : rows.vocab]


class _CrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of logits split over the vocabulary (Megatron-LM's
    ``_VocabParallelCrossEntropy``): three all-reduces forward, none backward."""

    @staticmethod
    def forward(
        ctx: Any,
        logits_NV: torch.Tensor,
        targets_N: torch.Tensor,
        lo: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        top_N = logits_NV.max(dim=-1).values
        all_reduce(top_N, group, dist.ReduceOp.MAX)
        shifted = logits_NV - top_N.unsqueeze(-1)
        local = targets_N - lo
        outside = (local < 0) | (local >= logits_NV.shape[-1])
        local = local.masked_fill(outside, 0)
        target_N = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(target_N, group)
        exp = shifted.exp()
        total_N = exp.sum(dim=-1)
        all_reduce(total_N, group)
        ctx.save_for_backward(exp.div_(total_N.unsqueeze(-1)), local, outside)
        return (total_N.log() - target_N).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= (~outside).to(g.dtype)
        return g * (grad / g.shape[0]), None, None, None


def vocab_parallel_loss(
    head: VocabParallelHead, logits_BTv: torch.Tensor, targets_BT: torch.Tensor
) -> torch.Tensor:
    """The mean cross-entropy of this rank's share of the logits ``logits_BTv`` (the head's
    training output) against ``targets_BT``: the same on every rank of the group."""
    flat = logits_BTv.reshape(-1, logits_BTv.shape[-1])
    out: torch.Tensor = _CrossEntropy.apply(
        flat, targets_BT.reshape(-1), head.rows.lo, head.rows.group
    )
    return out


def split_ends(module: StageModule, group: dist.ProcessGroup | None) -> None:
    """Split the stage ``module``'s token embedding and head projection (those it holds) over
    the vocabulary, in place; a tied pair stays one parameter."""
    embedding: VocabParallelEmbedding | None = None
    whole: torch.Tensor | None = None  # the embedding's matrix before the split
    for name, layer in zip(module.names, module.layers, strict=True):
        if name == "embedding":
            tok = layer.get_submodule("tok")
            assert isinstance(tok, nn.Embedding)
            embedding, whole = VocabParallelEmbedding(tok, group), tok.weight
            layer.tok = embedding
        elif name == "head":
            out = layer.get_submodule("out")
            assert isinstance(out, nn.Linear) and out.bias is None
            head = VocabParallelHead(out, group)
            if embedding is not None and out.weight is whole:
                head.weight = embedding.weight  # one shard, as it was one matrix
            layer.out = head


def stage_loss(
    module: StageModule, logits_BTV: torch.Tensor, targets_BT: torch.Tensor
) -> torch.Tensor:
    """The loss of the last stage ``module``'s output: on the split logits where its head is
    vocabulary-parallel and this forward kept them split, the whole cross-entropy otherwise."""
    head = module.layers[-1].get_submodule("out") if module.is_last else None
    if isinstance(head, VocabParallelHead) and logits_BTV.shape[-1] == head.rows.per:
        return vocab_parallel_loss(head, logits_BTV, targets_BT)
    return loss_fn(logits_BTV, targets_BT)
