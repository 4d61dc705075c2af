"""The tensor-parallel collectives of one micro-batch on one rank of a stage, call by call.

What :func:`dmsc.netmodel.iteration.estimate_iteration` prices at tp > 1, listed by layer, phase
and size so that a runtime's meter can be held to it call for call and byte for byte
(tests/runtime/compute/test_tensor_parallel.py): Megatron's ``g`` and ``f`` of each block
(Shoeybi et al., 2019, sec. 3), the embedding's forward sum and the head's backward one, a
mixture's router gradient carried in its backward sum, the vocabulary-parallel loss's three
per-token sums, and under full recomputation the blocks' forward sums again; in an inference
forward the vocabulary-parallel head's all-gather of the logits (its only call that is not an
all-reduce).

Under sequence parallelism (Korthikanti et al., MLSys 2023, sec. 4.2.2; the runtime's
``compute/sequence_parallel.py``) a training block's ``f`` is an all-gather of the sequence and
its ``g`` a reduce-scatter (each the full buffer's size, half an all-reduce's bytes), in the
backward the other way round, and every parameter a rank keeps whole (norms, row-parallel
biases) has its gradient summed in an all-reduce of its own. A mixture is priced the same way
without its routing sum (the runtime refuses sequence parallelism with experts).

The runtime's way into the blocks after the embedding and out of them before the head
(``JobSpec.sequence_parallel_edges``, ``gathered`` by default, ``ends`` here): the first block
slices the embedding's whole output (free; its backward an all-gather of the gradient) and the
last block's output is gathered whole for the head (an all-gather), one call a micro-batch each,
at the stages holding those blocks. Megatron fuses both into the embedding's and the head's sums
(``fused``: no call of their own), and the published sets are priced so: pricing a gather at
every stage boundary, as the runtime once ran them, moved them away (mean error on
megatron-core-h100 4.52% without, 5.27% with, ``netmodel/validation.py``). Between stages the
runtime's frames are each rank's slice of the sequence, as Megatron's, so a stage boundary costs
neither call (``runtime/compute/tensor_parallel.py``: ``split_edges``).
(``tests/runtime/compute/test_sequence_parallel.py`` and
``tests/integration/test_tensor_parallel_deployment.py`` hold the runtime to this list exactly.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmsc.netmodel.collectives import CollectiveKind
from dmsc.netmodel.layers import BLOCKS, LayerCost

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


def tp_allreduce_calls(
    layers: Sequence[LayerCost],
    train: bool,
    recompute: str,
    sequence_parallel: bool = False,
    ends: tuple[str, str] | None = None,
) -> list[TpCall]:
    """The collectives one tensor-parallel rank runs for one micro-batch through ``layers``
    (a training step's forward and backward when ``train``, a forward otherwise), ``recompute``
    the job's policy for the blocks; split along the sequence where ``sequence_parallel`` (a
    training step's blocks only: a forward without a graph runs as plain tensor parallelism).
    ``ends``, the names of the model's first and last block, adds the runtime's way into and out
    of the split region (``sequence_parallel_edges: gathered``): the first block's backward
    all-gathers its input's gradient, the last block's forward all-gathers its output whole
    (:func:`sequence_edges` gives them for a job)."""
    calls: list[TpCall] = []

    def add(
        lc: LayerCost, phase: str, nbytes: float, count: int, kind: CollectiveKind = "all_reduce"
    ) -> None:
        if nbytes > 0 and count > 0:
            calls.append(TpCall(lc.name, phase, nbytes, count, kind))

    for lc in layers:
        size = lc.tp_allreduce_bytes
        if sequence_parallel and train and lc.kind in BLOCKS and size:
            add(lc, "forward", size, 2, "all_gather")  # f, into attention and into the MLP
            add(lc, "forward", size, 2, "reduce_scatter")  # g, out of them
            add(lc, "backward", size, 2, "reduce_scatter")  # f's backward
            add(lc, "backward", size, 2, "all_gather")  # g's backward
            add(lc, "backward", lc.tp_whole_grad_bytes, lc.tp_whole_grads)
            if ends is not None and lc.name == ends[0]:
                add(lc, "backward", size, 1, "all_gather")  # the sliced input's gradient
            if ends is not None and lc.name == ends[-1]:
                add(lc, "forward", size, 1, "all_gather")  # the output, whole for the head
            if recompute == "full":
                add(lc, "recompute", size, 2, "all_gather")
                add(lc, "recompute", size, 2, "reduce_scatter")
            continue
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
        if lc.kind in BLOCKS and recompute == "full":
            add(lc, "recompute", size, lc.tp_allreduces_fwd)
    return calls


def sequence_edges(
    layers: Sequence[LayerCost], sequence_parallel: bool, edges: str
) -> tuple[str, str] | None:
    """The first and last block's names of the model ``layers`` where a sequence-parallel job
    gathers at its ends (``sequence_parallel_edges: gathered``); None where it does not."""
    blocks = [lc.name for lc in layers if lc.kind in BLOCKS]
    if not sequence_parallel or edges != "gathered" or not blocks:
        return None
    return blocks[0], blocks[-1]
