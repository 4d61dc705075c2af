"""Sequence parallelism on top of tensor parallelism (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023, sec. 4.2.2).

Under plain tensor parallelism (:mod:`.tensor_parallel`) every rank runs a block's norms and its
residual additions on the whole sequence: the same work, and the same activations kept, tp
times. With sequence parallelism the residual stream between the tensor-parallel sub-layers is
split along the sequence instead: rank r holds tokens ``r T/tp .. (r+1) T/tp``. Entering a
sub-layer's column-parallel linears, ``f`` becomes an all-gather of the sequence (its backward a
reduce-scatter of the input's partial gradients); leaving its row-parallel linear, ``g`` becomes
a reduce-scatter (its backward an all-gather), the same bytes as the all-reduce it replaces. The
first block after the embedding takes its slice of the whole input, and the last block's output
is gathered whole again before the head, so what the head and the loss see is that of plain
tensor parallelism. Between two stages whose blocks meet, the pipeline's frames carry each
rank's slice of the sequence (``StageModule.split_in`` / ``split_out``; the executor sends and
takes them as they are), Megatron's way: no gather at the boundary, and the same ``1/tp`` of the
bytes as a slice of the hidden dimension. A checkpoint and the losses do not change.

The norms and the row-parallel biases between the sub-layers see only their rank's tokens, so
their gradients are partial sums: each is summed over the ranks as it is computed (a hook on the
parameter), as Megatron sums its "sequence-parallel" parameters' gradients.

Only a forward that keeps its graph for a backward runs split: decoding and validation (without
gradients) run as plain tensor parallelism, whatever their length, and give the same outputs. A
training forward whose length the ranks do not divide is refused (the planner refuses such a
plan: ``dmsc.netmodel.iteration``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.tp_ops import all_reduce
from dmsc.runtime.compute.waiting import finish

__all__ = [
    "Run",
    "active",
    "gather_sequence",
    "gather_to_whole",
    "reduce_scatter_sequence",
    "slice_sequence",
    "split_blocks",
]


def active(enabled: bool) -> bool:
    """Whether this forward runs split: enabled for the stage and building a graph."""
    return enabled and torch.is_grad_enabled()


def _gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ranks' slices of dimension 1, concatenated in rank order."""
    tp = dist.get_world_size(group)
    part = x.movedim(1, 0).contiguous()
    out = part.new_empty((part.shape[0] * tp, *part.shape[1:]))
    with METER.timed("tp", (tp - 1) * part.numel() * part.element_size()):  # a ring's share
        work = dist.all_gather_single(out, part, group=group, async_op=True)
        finish(work, cpu=part.device.type == "cpu")  # awake while it runs (.waiting)
    return out.movedim(0, 1)


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum over the ranks of ``x``, this rank's slice of dimension 1.

    On the CPU it is gloo's all-to-all of the slices and this rank's sum of what it got: the
    same bytes on the wire as a reduce-scatter. gloo's own reduce-scatter
    (``reduce_scatter_single``, ``reduce_scatter_tensor`` before torch 2.13) returns a work that
    says it is done only once waited for (``is_completed`` stays false, and it has no
    future), so the awake wait (:func:`.waiting.finish`) ran to its bound on every call: 4.2-4.3
    ms a call of 256 KB between two processes, 0.6-1.7 blocked, and 0.25-0.32 by the all-to-all
    (torch 2.13, this project's CPU, 2026-12-05)."""
    tp = dist.get_world_size(group)
    whole = x.movedim(1, 0).contiguous()
    out = whole.new_empty((whole.shape[0] // tp, *whole.shape[1:]))
    with METER.timed("tp", (tp - 1) * out.numel() * out.element_size()):
        if whole.device.type == "cpu":
            got = torch.empty_like(whole)
            finish(dist.all_to_all_single(got, whole, group=group, async_op=True))
            torch.sum(got.view(tp, *out.shape), dim=0, out=out)
        else:
            work = dist.reduce_scatter_single(out, whole, group=group, async_op=True)
            finish(work, cpu=False)
    return out.movedim(0, 1)


def _slice(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of dimension 1 (its length divided by the ranks, else refused)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[1] % tp:
        raise ValueError(
            f"sequence parallelism: a length of {x.shape[1]} does not split over {tp} ranks"
        )
    n = x.shape[1] // tp
    return x[:, rank * n : (rank + 1) * n].contiguous()


Collective = Callable[[torch.Tensor, "dist.ProcessGroup | None"], torch.Tensor]


def _function(name: str, forward: Collective, backward: Collective, doc: str) -> Any:
    """An autograd function running ``forward`` over the group, and ``backward`` on the
    gradient."""

    def fwd(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None

    body = {"forward": staticmethod(fwd), "backward": staticmethod(bwd), "__doc__": doc}
    return type(name, (torch.autograd.Function,), body)


# f and g under sequence parallelism, and the ways into and out of the split region: the
# slice of a whole input (the same on every rank), whose backward gathers the slices'
# gradients so that every rank has the whole input's; and the whole output, gathered, after
# which every rank runs the same and so holds the whole gradient, of which it keeps its slice
_GatherEnter = _function("_GatherEnter", _gather, _reduce_scatter, "f: gather, reduce-scatter")
_ReduceScatter = _function("_ReduceScatter", _reduce_scatter, _gather, "g: reduce-scatter, gather")
_Slice = _function("_Slice", _slice, _gather, "into the split region")
_Whole = _function("_Whole", _gather, _slice, "out of the split region")


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out: torch.Tensor = _GatherEnter.apply(x, group)
    return out


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out: torch.Tensor = _ReduceScatter.apply(x, group)
    return out


def slice_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out: torch.Tensor = _Slice.apply(x, group)
    return out


def gather_to_whole(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out: torch.Tensor = _Whole.apply(x, group)
    return out


def _sum_over(group: dist.ProcessGroup | None) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(out, group)
        return out

    return hook


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of a stage, run split along the sequence; ``sliced``: the first
    takes its slice of a whole input (else its input is the slice already: a pipeline frame
    from a block of another stage), ``gathered``: the last gives its output whole (else its
    slice, for the next stage's block)."""

    blocks: list[nn.Module]
    sliced: bool = True
    gathered: bool = True


def split_blocks(runs: list[Run], whole: set[str], group: dist.ProcessGroup | None) -> None:
    """Run each run of consecutive blocks in ``runs`` split along the sequence, into and out
    of it as the run says; the parameters of each block whose names are in ``whole`` (norms,
    row-parallel biases: whole on every rank, fed only this rank's tokens) get their gradients
    summed over ``group``."""

    def take_slice(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():
            return None
        return (slice_sequence(args[0], group), *args[1:]), kwargs

    def give_whole(_m: nn.Module, _args: Any, _kwargs: Any, out: torch.Tensor) -> Any:
        return gather_to_whole(out, group) if torch.is_grad_enabled() else None

    for run in runs:
        if run.sliced:
            run.blocks[0].register_forward_pre_hook(take_slice, with_kwargs=True)
        if run.gathered:
            run.blocks[-1].register_forward_hook(give_whole, with_kwargs=True)
        for block in run.blocks:
            for name, param in block.named_parameters():
                if name in whole:
                    param.register_hook(_sum_over(group))
