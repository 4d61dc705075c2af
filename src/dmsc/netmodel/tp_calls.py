"""The tensor-parallel collectives of one micro-batch on one rank of a stage, call by call.

What :func:`dmsc.netmodel.iteration.estimate_iteration` prices at tp > 1, listed by layer, phase
and size so that a runtime's meter can be held to it call for call and byte for byte
(tests/runtime/compute/test_tensor_parallel.py): Megatron's ``g`` and ``f`` of each block
(Shoeybi et al., 2019, sec. 3), the embedding's forward sum and the head's backward one, a
mixture's router gradient carried in its backward sum, the vocabulary-parallel loss's three
per-token sums, and under full recomputation the blocks' forward sums again; in an inference
forward the vocabulary-parallel head's all-gather of the logits (its only call that is not an
all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmsc.netmodel.collectives import CollectiveKind
from dmsc.netmodel.layers import LayerCost

__all__ = ["TpCall", "tp_allreduce_calls"]


@dataclass(frozen=True)
class TpCall:
    """``count`` calls of ``kind`` (an all-reduce unless said) of an ``nbytes`` buffer in
    ``layer``'s ``phase`` (``forward``, ``backward`` or ``recompute``)."""

    layer: str
    phase: str
    nbytes: float
    count: int
    kind: CollectiveKind = "all_reduce"


def tp_allreduce_calls(layers: Sequence[LayerCost], train: bool, recompute: str) -> list[TpCall]:
    """The all-reduces one tensor-parallel rank runs for one micro-batch through ``layers``
    (a training step's forward and backward when ``train``, a forward otherwise), ``recompute``
    the job's policy for the blocks."""
    calls: list[TpCall] = []

    def add(
        lc: LayerCost, phase: str, nbytes: float, count: int, kind: CollectiveKind = "all_reduce"
    ) -> None:
        if nbytes > 0 and count > 0:
            calls.append(TpCall(lc.name, phase, nbytes, count, kind))

    for lc in layers:
        size = lc.tp_allreduce_bytes
        add(lc, "forward", size, lc.tp_allreduces_fwd)
        if not train:
            add(lc, "forward", lc.tp_logits_gather_bytes, 1, "all_gather")
            continue
        add(lc, "forward", lc.tp_loss_allreduce_bytes, lc.tp_loss_allreduces)
        bwd = lc.tp_allreduces_bwd
        if lc.tp_router_grad_bytes and bwd and size:
            add(lc, "backward", size + lc.tp_router_grad_bytes, 1)
            bwd -= 1
        add(lc, "backward", size, bwd)
        if lc.kind in ("block", "moe_block") and recompute == "full":
            add(lc, "recompute", size, lc.tp_allreduces_fwd)
    return calls
