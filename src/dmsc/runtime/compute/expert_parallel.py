"""Expert parallelism for a mixture of experts (GShard, Lepikhin et al. 2020; Mixtral's routing).

The ``dp`` data-parallel replicas of a stage form groups of ``ep`` consecutive replicas (the cost
model's layout, :class:`dmsc.netmodel.parallel.Layout`). Within a group each replica runs its own
micro-batches, as in data parallelism, but holds only ``experts / ep`` of each mixture's experts:
rank ``r`` keeps experts ``r * E / ep`` .. ``(r + 1) * E / ep - 1``; the router, the attention and
everything else stay whole on every rank. A mixture routes its tokens locally, sends each token
to the rank of each expert it chose (one all-to-all), runs the tokens it received through its
own experts, and sends the results back (a second all-to-all), where they are weighted by the
router and summed. The backward runs the same two exchanges in reverse: four all-to-alls per
mixture and step, the ``ep`` term the cost model prices (``netmodel/iteration.py``). A third,
small one tells each rank how many tokens it receives for each of its experts. All of them are
timed on the step's meter (:mod:`.comm_meter`), the backward's two included.

The exchange is a differentiable all-to-all, its backward the reverse all-to-all
(:class:`_AllToAll`), run by the group's own ``alltoall_base``; gloo runs it on CPU with uneven
splits. Not ``torch.distributed._functional_collectives.all_to_all_single`` (which torch 2.13
names as the replacement of the deprecated ``torch.distributed.nn.functional`` one): it takes
only a group registered in torch's world, and at tp > 1 the expert-parallel group is a second
group beside the tensor-parallel one (the process's default), a ``ProcessGroupGloo`` formed from
the store; torch 2.13 refuses it ("Unsupported group type", tried). Every rank of an
expert-parallel group must call a mixture's forward together, with any number of tokens, none
included (a decoding step's one token too).

With tensor parallelism (tp > 1, without sequence parallelism) each replica is tp processes,
each holding the tp-rank-``t`` shard (Megatron-style, :mod:`.tensor_parallel`) of the replica's
experts: tp rank ``t`` of a replica exchanges tokens with tp rank ``t`` of the other replicas of
its expert-parallel group. Every tp rank of a replica holds the same tokens and the same router,
so it routes them alike and sends and receives the same rows as its tp peers; each expert runs
its column-parallel gate and up and its row-parallel down on them, the down's partial output
not summed yet, and the partials go back and are weighted by the router and added up per token
(both linear: the sum over tp ranks may come last). Then one all-reduce over the replica's tp
ranks sums them (Megatron's ``g``), and in the backward one all-reduce sums the partial
gradients of the tokens sent to the experts (``f``, on the experts' path only: the router's
input gradient is whole on every rank already). The router's weights multiply partial outputs,
so their gradient is partial too: it rides in the same backward all-reduce (B x T x top_k
numbers more than the B x T x hidden of the tokens, :class:`.tp_ops.EnterPair`). Per mixture
that is one tensor-parallel all-reduce of the layer's B x T x hidden each way, as the cost model
prices every block's MLP (``netmodel/layers.py``: ``tp_allreduces_fwd``, ``tp_allreduces_bwd``,
and the router's gradient: ``tp_router_grad_bytes``), and all-to-alls of
B x T x top_k x hidden per tp rank in ep groups of tp rank t of each replica
(``netmodel/parallel.py``: ``Layout.ep_groups``). The all-to-alls and the all-reduces run in
the same order on every process, so the two kinds of group never wait on each other. At
ep = 1 the same mixture, exchanging nothing, is a tensor-parallel replica's
(:func:`.tensor_parallel.parallelize_stage`), and :func:`parallelize_experts` cuts it to a
rank's share of the experts when the plan has ep > 1 too.

Parameter names stay those of the whole model: a rank's experts keep their global numbers
(``mlp.experts.2.gate.weight`` on rank 1 of ep = 2 with four experts), so a rank's state dict
is the whole one without the other ranks' experts. :func:`gather_state_dict` makes the ep = 1
state dict of an expert-parallel stage and :func:`shard_state_dict` the reverse.

Gradients (:func:`gradient_averaging`): a parameter held by every replica is averaged over all
``dp`` of them, as without experts. An expert's gradient already sums what every rank of its
expert-parallel group sent it, each rank's loss a mean over its own tokens; so it is summed
over the ``dp / ep`` replicas that hold the same expert and divided by ``dp`` too, which gives
the gradient of the mean loss over all the replicas' tokens (with equal batches per replica).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmsc.netmodel.parallel import Group, Layout
from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.models.llama import MixtureOfExperts, SwiGLU
from dmsc.runtime.compute.tp_ops import EnterPair, Reduce
from dmsc.runtime.compute.waiting import finish

_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")


def check_ep_divisible(experts: int, ep: int) -> None:
    """A ValueError unless ``ep`` ranks can hold an equal share of ``experts``."""
    if ep < 1 or experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's experts ({experts})")


def expert_of(name: str) -> int | None:
    """The global number of the expert a state-dict key belongs to; None: not an expert's."""
    match = _EXPERT.search(name)
    return None if match is None else int(match.group(2))


def _renamed(name: str, expert: int) -> str:
    """``name`` with its expert number replaced by ``expert``."""
    match = _EXPERT.search(name)
    assert match is not None
    return f"{name[: match.start(2)]}{expert}{name[match.end(2) :]}"


def _group(group: Any) -> Any:
    """``group`` (a ProcessGroup or a gloo backend formed from a store), or the default group."""
    return dist.distributed_c10d._get_default_group() if group is None else group


def _all_to_all(x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int]) -> Any:
    """Rows of ``x`` in ``in_splits`` runs to the group's ranks; what arrives, by source rank."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = _group(group).alltoall_base(out, x.contiguous(), out_splits, in_splits)
    finish(work, cpu=x.device.type == "cpu")  # awake while it runs (.waiting)
    return out


class _AllToAll(torch.autograd.Function):
    """The differentiable all-to-all: the forward sends rows of ``x``, the backward sends their
    gradients back the reverse way (the splits swapped). Both ways are on the step's meter as
    ``ep``, each with the bytes that left this rank (its own rows cross no link)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int]
    ) -> Any:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        with torch.profiler.record_function("ep::all_to_all"):
            return _metered_all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        out_splits, in_splits = ctx.splits
        with torch.profiler.record_function("ep::all_to_all"):
            back = _metered_all_to_all(grad, ctx.group, in_splits, out_splits)
            return back, None, None, None


def _metered_all_to_all(
    x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    """:func:`_all_to_all` timed on the step's meter, with the bytes of the rows sent away."""
    me = _group(group).rank()
    away = (sum(in_splits) - in_splits[me]) * x[:1].numel() * x.element_size()
    with METER.timed("ep", away):
        out: torch.Tensor = _all_to_all(x, group, out_splits, in_splits)
    return out


def _partial(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A SwiGLU expert on ``x`` with this rank's hidden units: its whole output at tp = 1, at
    tp > 1 this rank's part of the sum (its row-parallel ``down`` not reduced)."""
    assert isinstance(expert, SwiGLU)
    gate, up, down = expert.gate, expert.up, expert.down
    assert gate.bias is None and up.bias is None and down.bias is None
    return F.linear(F.silu(F.linear(x, gate.weight)) * F.linear(x, up.weight), down.weight)


class ExpertParallelMoE(nn.Module):
    """A :class:`MixtureOfExperts` with this rank's share of its experts, the others on the
    other ranks of ``group``; it computes what the whole mixture computes on this rank's tokens.
    ``rank`` and ``ep`` given, no group need exist yet (a worker forms it at its first step:
    :mod:`.ep_worker`); ``group`` is then set before the first forward. ``group``: a
    ProcessGroup, a gloo backend formed from a store (a second group beside the default one),
    or None (the default group). At ``ep`` = 1 it exchanges nothing: every expert is local,
    which is the mixture of a tensor-parallel replica without expert parallelism
    (:func:`.tensor_parallel.parallelize_stage`). ``tp`` > 1: the experts are already split
    Megatron-style over the ``tp`` ranks of ``tp_group`` (None: the default group), and their
    partial outputs are summed once for the whole mixture; ``full`` may then be such a mixture
    at ep = 1 (its ``tp`` and ``tp_group`` carried over)."""

    def __init__(
        self,
        full: MixtureOfExperts | ExpertParallelMoE,
        group: Any = None,
        rank: int | None = None,
        ep: int | None = None,
        tp: int = 1,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(full, ExpertParallelMoE):
            if full.ep != 1:
                raise ValueError(f"a mixture already split over ep={full.ep} ranks")
            tp, tp_group = full.tp, full.tp_group
        rank = _group(group).rank() if rank is None else rank
        ep = _group(group).size() if ep is None else ep
        whole = list(full.experts.values() if isinstance(full, ExpertParallelMoE) else full.experts)
        check_ep_divisible(len(whole), ep)
        self.group: Any = group
        self.ep: int = ep
        self.top_k: int = full.top_k
        self.tp: int = tp
        self.tp_group: Any = tp_group
        self.local = len(whole) // ep
        self.first = rank * self.local
        self.router: nn.Linear = full.router
        self.experts: nn.ModuleDict = nn.ModuleDict(
            {str(e): whole[e] for e in range(self.first, self.first + self.local)}
        )

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        flat = x_BTH.reshape(-1, x_BTH.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(flat.dtype)
        # every (token, choice) pair, ordered by expert (and so by rank), token order within
        expert = chosen.reshape(-1)
        order = torch.argsort(expert, stable=True)
        rows = order // self.top_k
        picked = weight.reshape(-1)[order, None]
        src = flat
        if self.tp > 1:
            # f on the experts' path (their partial input gradients) and on the router's
            # weights (they multiply partial outputs, so their gradients are partial too):
            # both summed over the tp ranks in one all-reduce of the backward
            src, picked = EnterPair.apply(flat, picked, self.tp_group)
        counts = torch.bincount(expert, minlength=self.local * self.ep)
        if self.ep == 1:
            received, tokens = counts, src[rows]
        else:
            received = torch.empty_like(counts)
            # what each rank sends this one, for each of its experts: [source rank, local expert]
            with METER.timed("ep", counts.numel() * counts.element_size()):
                _group(self.group).alltoall_base(received, counts, [], []).wait()
            send_splits = counts.view(self.ep, self.local).sum(dim=1).tolist()
            recv_splits = received.view(self.ep, self.local).sum(dim=1).tolist()
            METER.count_tokens(sum(send_splits), sum(recv_splits))  # the routing's balance
            tokens = _AllToAll.apply(src[rows], self.group, recv_splits, send_splits)
        local_ids = torch.arange(self.local).repeat(self.ep)
        of_expert = torch.repeat_interleave(local_ids, received)
        done = torch.zeros_like(tokens)
        for j, module in enumerate(self.experts.values()):
            (at,) = (of_expert == j).nonzero(as_tuple=True)
            if at.numel():
                done.index_copy_(0, at, _partial(module, tokens[at]))
        back = done if self.ep == 1 else _AllToAll.apply(done, self.group, send_splits, recv_splits)
        out = torch.zeros_like(flat).index_add_(0, rows, back * picked)
        if self.tp > 1:  # g: the tp ranks' partial sums, once for the whole mixture
            out = Reduce.apply(out, self.tp_group)
        return out.view_as(x_BTH)


def parallelize_experts(
    module: nn.Module,
    group: Any = None,
    rank: int | None = None,
    ep: int | None = None,
) -> nn.Module:
    """Replace every :class:`MixtureOfExperts` in ``module`` (built whole, from the seed or an
    ep = 1 checkpoint), and every ep = 1 :class:`ExpertParallelMoE` of a tensor-parallel stage,
    in place by this rank's :class:`ExpertParallelMoE` over ``group`` (rank ``rank`` of ``ep``
    when given: see :class:`ExpertParallelMoE`)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MixtureOfExperts | ExpertParallelMoE):
                setattr(parent, name, ExpertParallelMoE(child, group, rank, ep))
    return module


def shard_state_dict(
    full: dict[str, torch.Tensor], experts: int, rank: int, ep: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s of ``ep`` state dict of an ep = 1 one whose mixtures have ``experts``
    experts: everything but the other ranks' experts."""
    check_ep_divisible(experts, ep)
    local = experts // ep
    keep = range(rank * local, (rank + 1) * local)
    return {k: t for k, t in full.items() if (e := expert_of(k)) is None or e in keep}


def all_gather(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """``t`` of every rank of ``group`` (see :class:`ExpertParallelMoE`), in rank order."""
    parts = [torch.empty_like(t) for _ in range(_group(group).size())]
    finish(_group(group).allgather([parts], [t.detach().contiguous()]), cpu=t.device.type == "cpu")
    return parts


def gather_state_dict(module: nn.Module, group: Any = None) -> dict[str, torch.Tensor]:
    """The ep = 1 state dict of an expert-parallel stage, on every rank of its ``group`` (each
    expert's tensors all-gathered from the rank holding it; a collective: every rank calls it)."""
    rank = _group(group).rank()
    sizes = {m.local for m in module.modules() if isinstance(m, ExpertParallelMoE)}
    if len(sizes) > 1:
        raise ValueError(f"the mixtures hold different numbers of experts per rank: {sizes}")
    local = sizes.pop() if sizes else 0
    out = {}
    for name, tensor in module.state_dict().items():
        expert = expert_of(name)
        if expert is None:
            out[name] = tensor.detach().clone()
            continue
        slot = expert - rank * local
        for source, part in enumerate(all_gather(tensor, group)):
            out[_renamed(name, source * local + slot)] = part
    return out


@dataclass(frozen=True)
class Averaging:
    """How one kind of gradient is averaged over the data-parallel replicas: summed within
    each of ``groups`` (of data-parallel ranks), then divided by ``divisor``."""

    groups: tuple[Group, ...]
    divisor: int

    def group_of(self, dp_rank: int) -> Group:
        """The group data-parallel rank ``dp_rank`` sums this kind of gradient with."""
        return next(g for g in self.groups if dp_rank in g)


Kind = Literal["dense", "expert"]


def gradient_averaging(dp: int, ep: int) -> dict[Kind, Averaging]:
    """How the gradients of ``dp`` replicas in expert-parallel groups of ``ep`` are averaged:
    ``dense`` (held by every replica) over all of them, ``expert`` over the replicas holding the
    same experts (one from each expert-parallel group), both divided by ``dp``."""
    if ep < 1 or dp < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    layout = Layout(tp=1, pp=1, dp=dp, ep=ep, first_device=0)
    return {
        "dense": Averaging(tuple(layout.dp_groups(0)), dp),
        "expert": Averaging(tuple(layout.expert_dp_groups(0)), dp),
    }


def expert_parallel_groups(dp: int, ep: int) -> list[Group]:
    """The data-parallel ranks exchanging tokens: runs of ``ep`` consecutive replicas; a
    replica's rank in its group (its share of the experts) is its data-parallel rank mod ep."""
    if ep < 1 or dp < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    return Layout(tp=1, pp=1, dp=dp, ep=ep, first_device=0).ep_groups(0)


def kind_of(name: str) -> Kind:
    """Whether the parameter ``name`` (a state-dict key) is an expert's or held by every rank."""
    return "dense" if expert_of(name) is None else "expert"
