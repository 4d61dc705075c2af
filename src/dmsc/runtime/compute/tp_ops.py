"""The tensor-parallel group's two autograd operators and its metered all-reduce, shared by the
blocks (:mod:`.tensor_parallel`), the vocabulary-split ends (:mod:`.vocab_parallel`) and the
sequence split (:mod:`.sequence_parallel`).

Megatron-LM's ``f`` and ``g`` (Shoeybi et al., 2019, sec. 3, fig. 3): ``f`` (:class:`Enter`) is
the identity forward and an all-reduce of the gradient backward, placed where a column-parallel
layer's input enters; ``g`` (:class:`Reduce`) an all-reduce forward and the identity backward,
where a row-parallel layer's partial outputs leave; :class:`EnterPair` is ``f`` on two inputs
whose gradients share one all-reduce. Every all-reduce here books its time and a
ring's bytes on the step's meter (:mod:`.comm_meter`): gloo and NCCL both run a ring for these
(the data-parallel all-reduce's algorithms are :mod:`.allreduce`'s).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dmsc.runtime.compute.comm_meter import METER, ring_allreduce_bytes
from dmsc.runtime.compute.waiting import finish

__all__ = ["Enter", "EnterPair", "Reduce", "all_reduce"]


def all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup | None, op: Any = dist.ReduceOp.SUM
) -> None:
    """Reduce ``x`` over the group in place (a sum unless ``op`` says otherwise), its time and
    ring bytes on the step's meter."""
    n = dist.get_world_size(group)
    with METER.timed("tp", ring_allreduce_bytes(x.numel(), x.element_size(), n)):
        work = dist.all_reduce(x, op=op, group=group, async_op=True)
        finish(work, cpu=x.device.type == "cpu")  # awake while it runs (.waiting)


class Enter(torch.autograd.Function):
    """Megatron's ``f``: the identity forward; the backward sums the ranks' partial gradients
    of the input (each rank's column shard contributes its part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, ctx.group)
        return grad, None


class EnterPair(torch.autograd.Function):
    """``f`` on two inputs at once: the identity forward; the backward sums both gradients
    over the ranks in one all-reduce (a mixture's tokens and router weights,
    :mod:`.expert_parallel`: one call where two would each pay the latency)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, y: torch.Tensor, group: dist.ProcessGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != y.dtype:
            raise ValueError(f"EnterPair: {x.dtype} and {y.dtype} cannot share one all-reduce")
        ctx.group = group
        return x.view_as(x), y.view_as(y)

    @staticmethod
    def backward(
        ctx: Any, grad_x: torch.Tensor, grad_y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        both = torch.cat([grad_x.reshape(-1), grad_y.reshape(-1)])
        all_reduce(both, ctx.group)
        gx, gy = both.split([grad_x.numel(), grad_y.numel()])
        return gx.view_as(grad_x), gy.view_as(grad_y), None


class Reduce(torch.autograd.Function):
    """Megatron's ``g``: the forward sums the ranks' partial outputs; the backward passes the
    gradient through (every rank holds the whole output's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
