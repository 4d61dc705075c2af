"""Pipeline frames at tp > 1: each rank sends its share, the next stage gathers them.

Every rank of a tensor-parallel stage holds the same whole activation at the stage's end (and,
in the backward, the same whole gradient of its input). Sending it whole from every rank to the
same rank of the next stage put ``tp`` times the bytes on the pipeline's links that the cost
model prices (``netmodel/layers.py``: a boundary activation is ``B T h / tp`` a device, Megatron's
scatter-gather of pipeline tensors, Narayanan et al. SC'21 sec. 4.1). So rank ``r`` sends the
``r``-th of ``tp`` slices along the hidden dimension, and the receiving stage gathers the slices
over its tensor-parallel group (an all-gather among the ranks of one replica, which share a
node) before it computes: the same tensor as before, ``1/tp`` of the bytes on the link.

Every activation and gradient frame between stages goes this way at tp > 1: a training or
evaluation step's, and the activations a chained inference step hands on (:mod:`.relay`); the
receiving stage's ranks run the same steps in the same order, so their gathers pair up."""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``t`` along its last dimension (``t`` itself at tp = 1)."""
    if tp == 1:
        return t
    return t.chunk(tp, dim=-1)[rank].contiguous()


def whole(t: torch.Tensor, tp: int) -> torch.Tensor:
    """The ranks' slices gathered along the last dimension, in rank order, over this process's
    tensor-parallel group (its default process group); ``t`` itself at tp = 1."""
    if tp == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t)
    return torch.cat(parts, dim=-1)
