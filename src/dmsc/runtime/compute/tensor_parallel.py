"""Tensor parallelism inside a stage replica, Megatron-style (Shoeybi et al., "Megatron-LM", 2019).

A stage's blocks are split over the ranks of a tensor-parallel process group: the attention by
heads (its q, k, v projections column-parallel, its output projection row-parallel) and the MLP
by its hidden units (the first projections column-parallel, the last row-parallel). Each
sub-layer then costs one all-reduce in the forward (summing the row-parallel partial outputs)
and one in the backward (summing the column-parallel inputs' partial gradients): Megatron's
``g`` and ``f`` operators. The token embedding and the head's projection are split over the
vocabulary, and the loss computed on the split logits (:mod:`.vocab_parallel`). The position
embedding, the norms, the row-parallel biases and a mixture of experts' router stay whole on
every rank; they compute the same values everywhere and so get the same gradients without a
collective (with sequence parallelism the blocks' norms
and row-parallel biases see a slice of the sequence each: :mod:`.sequence_parallel`). Mixtral's
experts are split like the MLP, and the mixture becomes an
:class:`~.expert_parallel.ExpertParallelMoE` at ep = 1: the router weights each expert's
partial output and adds them up per token (both linear, so the sum over the ranks may come
last), then one all-reduce sums the mixture's output, and one in the backward sums the tokens'
and the router weights' partial gradients together. That is a mixture's two all-reduces, as the
cost model prices every block's MLP (``netmodel/layers.py``), where an all-reduce per expert
that got tokens would cost up to ``experts`` calls and ``top_k`` times the bytes.

Parameter names stay those of the whole model, each holding the rank's shard:
:func:`gather_state_dict` makes a tp = 1 state dict of a tp = N stage and
:func:`shard_state_dict` the reverse, so a checkpoint moves across a change of tp.

Why hand-written column and row linears and not ``torch.distributed.tensor.parallel``
(``ColwiseParallel``/``RowwiseParallel`` on a ``DeviceMesh``): measured with
``benchmarks/tensor_parallel_cpu.py`` (results/tensor_parallel_cpu.json: two gloo processes of
one thread on this project's 2-core CPU machine, torch 2.13, both splits in the same processes,
steps in turn), a forward and backward of gpt-mini (4 blocks, hidden 128, 8 x 128 tokens) took
311 ms with these and 516 ms with DTensor (1.58 and 1.66 times in two runs), the same model
with hidden 512 3.63 s and 3.70 s (0.97 and 1.02 times): DTensor's per-op dispatch (sharding
propagation on every ``DTensor``) costs up to two thirds more where the GEMMs are small and
nothing where they are large, for the same two all-reduces per sub-layer and the same losses to
the bit. Its parameters would also be ``DTensor``s, which the optimizer, the gradient sync and
the checkpoints here would each have to unwrap; these are plain tensors. Nor can
``torch.distributed.nn.functional.all_reduce`` serve as ``g``: its backward all-reduces the
gradient again, which with the output's gradient whole on every rank (the loss is the same on
every rank) multiplies the gradients by tp.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmsc.runtime.compute import sequence_parallel, vocab_parallel
from dmsc.runtime.compute.expert_parallel import ExpertParallelMoE
from dmsc.runtime.compute.models import gpt, llama
from dmsc.runtime.compute.models.chain import StageModule
from dmsc.runtime.compute.models.support import check_tp_divisible
from dmsc.runtime.compute.tp_ops import Enter, Reduce
from dmsc.spec import TransformerSpec

Split = Literal["column", "qkv", "row", "vocab"]

# How each split parameter of a stage divides over the ranks, by its state-dict name: "column"
# (by output rows), "qkv" (GPT's fused q, k, v: each third by output rows), "row" (by inputs),
# "vocab" (the token embedding's and the head's rows, padded to a multiple of tp)
_VOCAB: list[tuple[re.Pattern[str], Split]] = [(re.compile(r"\.(tok|out)\.weight$"), "vocab")]
_SPLITS: dict[str, list[tuple[re.Pattern[str], Split]]] = {
    "gpt": [
        *_VOCAB,
        (re.compile(r"\.qkv\.(weight|bias)$"), "qkv"),
        (re.compile(r"\.fc1\.(weight|bias)$"), "column"),
        (re.compile(r"\.(proj|fc2)\.weight$"), "row"),
    ],
    "llama": [
        *_VOCAB,
        (re.compile(r"\.attn\.[qkv]\.(weight|bias)$"), "column"),
        (re.compile(r"\.(gate|up)\.weight$"), "column"),
        (re.compile(r"\.attn\.o\.weight$"), "row"),
        (re.compile(r"\.down\.weight$"), "row"),
    ],
}


def split_of(spec: TransformerSpec, name: str) -> Split | None:
    """How the parameter ``name`` (a stage's state-dict key) splits; None: whole on every rank."""
    for pattern, split in _SPLITS["gpt" if spec.family == "gpt" else "llama"]:
        if pattern.search(name):
            return split
    return None


def shard(tensor: torch.Tensor, split: Split, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of a whole ``tensor`` split as ``split`` says."""
    if split == "vocab":
        return vocab_parallel.shard_rows(tensor, rank, tp)
    if split == "row":
        return tensor.chunk(tp, dim=1)[rank].contiguous()
    if split == "qkv":
        thirds = tensor.view(3, -1, *tensor.shape[1:])
        return thirds.chunk(tp, dim=1)[rank].reshape(-1, *tensor.shape[1:]).contiguous()
    return tensor.chunk(tp, dim=0)[rank].contiguous()


def unshard(parts: list[torch.Tensor], split: Split, vocab: int = 0) -> torch.Tensor:
    """The whole tensor of the ranks' ``parts`` (in rank order): :func:`shard` undone (a
    "vocab" split's padding dropped: the model's ``vocab`` rows kept)."""
    if split == "vocab":
        return vocab_parallel.unshard_rows(parts, vocab)
    if split == "row":
        return torch.cat(parts, dim=1)
    if split == "qkv":
        thirds = [p.view(3, -1, *p.shape[1:]) for p in parts]
        whole = torch.cat(thirds, dim=1)
        return whole.reshape(-1, *parts[0].shape[1:])
    return torch.cat(parts, dim=0)


def shard_state_dict(
    spec: TransformerSpec, full: dict[str, torch.Tensor], rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """A tp = 1 stage state dict cut into rank ``rank``'s of ``tp`` (same keys)."""
    check_tp_divisible(spec, tp)
    out = {}
    for name, tensor in full.items():
        split = split_of(spec, name)
        out[name] = tensor if split is None else shard(tensor, split, rank, tp)
    return out


def gather_state_dict(
    spec: TransformerSpec, module: nn.Module, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """The tp = 1 state dict of a tensor-parallel stage, on every rank of its ``group`` (each
    split parameter all-gathered from the ranks; a collective: every rank calls it)."""
    tp = dist.get_world_size(group)
    out = {}
    for name, tensor in module.state_dict().items():
        split = split_of(spec, name)
        if split is None:
            out[name] = tensor.detach().clone()
            continue
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        out[name] = unshard(parts, split, spec.vocab)
    return out


def enter(x: torch.Tensor, group: dist.ProcessGroup | None, seq: bool = False) -> torch.Tensor:
    """``f``; with ``seq`` (sequence parallelism, in a forward that keeps its graph) the
    all-gather of the sequence's slices (:mod:`.sequence_parallel`)."""
    if sequence_parallel.active(seq):
        return sequence_parallel.gather_sequence(x, group)
    out: torch.Tensor = Enter.apply(x, group)
    return out


def reduce(x: torch.Tensor, group: dist.ProcessGroup | None, seq: bool = False) -> torch.Tensor:
    """``g``; with ``seq``, the reduce-scatter to the sequence's slices."""
    if sequence_parallel.active(seq):
        return sequence_parallel.reduce_scatter_sequence(x, group)
    out: torch.Tensor = Reduce.apply(x, group)
    return out


class ColumnParallelLinear(nn.Module):
    """A linear layer's share of output features (its input whole on every rank). With
    ``enters``, it applies ``f`` itself (its sub-layer's only column-parallel layer); otherwise
    its sub-layer does once for all of them (:func:`_enter_hook`)."""

    def __init__(
        self,
        full: nn.Linear,
        group: dist.ProcessGroup | None,
        enters: bool,
        qkv: bool,
        seq: bool = False,
    ) -> None:
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        split: Split = "qkv" if qkv else "column"
        self.group, self.enters, self.seq = group, enters, seq
        self.weight = nn.Parameter(shard(full.weight.detach(), split, rank, tp))
        self.bias = (
            None if full.bias is None else nn.Parameter(shard(full.bias.detach(), split, rank, tp))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enters:
            x = enter(x, self.group, self.seq)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """A linear layer's share of input features: its partial outputs summed over the ranks
    (``g``), then its bias, whole on every rank, added once."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup | None, seq: bool = False) -> None:
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.seq = group, seq
        self.weight = nn.Parameter(shard(full.weight.detach(), "row", rank, tp))
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce(F.linear(x, self.weight), self.group, self.seq)
        return y if self.bias is None else y + self.bias


def _enter_hook(
    group: dist.ProcessGroup | None, seq: bool = False
) -> Callable[..., tuple[Any, ...]]:
    """A forward pre-hook applying ``f`` once to a sub-layer's input, before its several
    column-parallel layers (Llama's q, k, v; SwiGLU's gate and up) read it."""

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (enter(args[0], group, seq), *args[1:])

    return hook


def parallelize_stage(
    spec: TransformerSpec,
    module: StageModule,
    group: dist.ProcessGroup | None = None,
    sequence: bool = False,
    vocab: bool = True,
) -> StageModule:
    """Split ``module``'s blocks (built whole, from the seed or a tp = 1 checkpoint) in place
    over the ranks of ``group``: this rank keeps its shard of every split parameter. With
    ``sequence``, the residual stream between the sub-layers is split along the sequence too
    (:mod:`.sequence_parallel`; not for a mixture of experts, whose routing picks each rank's
    tokens). With ``vocab`` (the default), the token embedding and the head are split over the
    vocabulary (:mod:`.vocab_parallel`; the loss then by :func:`.vocab_parallel.stage_loss`)."""
    tp = dist.get_world_size(group)
    check_tp_divisible(spec, tp)
    if sequence and spec.is_moe:
        raise ValueError(
            "sequence parallelism with a mixture of experts: each rank's router would pick "
            "experts for its own tokens only"
        )
    seq = sequence
    for layer in module.layers:
        if isinstance(layer, gpt.Block):
            _column(layer, "qkv", group, enters=True, qkv=True, seq=seq)
            _column(layer, "fc1", group, enters=True, seq=seq)
            _row(layer, "proj", group, seq)
            _row(layer, "fc2", group, seq)
        elif isinstance(layer, llama.Block):
            attn = layer.attn
            attn.heads, attn.kv_heads = attn.heads // tp, attn.kv_heads // tp
            for name in ("q", "k", "v"):
                _column(attn, name, group)
            _row(attn, "o", group, seq)
            attn.register_forward_pre_hook(_enter_hook(group, seq))
            if isinstance(layer.mlp, llama.MixtureOfExperts):
                # each expert split alike, their partial outputs combined by the router, then
                # summed over the ranks once for the whole mixture (not once per expert)
                for mlp in layer.mlp.experts:
                    _column(mlp, "gate", group)
                    _column(mlp, "up", group)
                    _row(mlp, "down", group, seq)
                layer.mlp = ExpertParallelMoE(layer.mlp, None, 0, 1, tp, group)
            else:
                _column(layer.mlp, "gate", group)
                _column(layer.mlp, "up", group)
                _row(layer.mlp, "down", group, seq)
                layer.mlp.register_forward_pre_hook(_enter_hook(group, seq))
    if vocab:
        vocab_parallel.split_ends(module, group)
    if sequence:
        module.split_in, module.split_out = split_edges(module, spec.layers)
        runs = _block_runs(module)
        whole = {n for r in runs for n in _whole_names(r.blocks[0])}
        sequence_parallel.split_blocks(runs, whole, group)
    return module


def split_edges(module: StageModule, blocks: int) -> tuple[frozenset[int], frozenset[int]]:
    """The chunks of ``module`` (of a model of ``blocks`` blocks) whose input, and those whose
    output, cross a stage boundary between two blocks: under sequence parallelism the blocks on
    both sides hold the sequence split, so those frames carry each rank's slice of it, as
    Megatron's do (Korthikanti et al. 2023, sec. 4.2.2), and no rank gathers the whole. Next to
    the embedding or the head the frames stay whole activations (each rank's share of the
    hidden dimension: :mod:`..pp_shards`)."""
    into, out = set(), set()
    for c, (lo, hi) in enumerate(module.spans):
        if module.names[lo] not in ("embedding", "head", "block_0"):
            into.add(c)
        if module.names[hi - 1] not in ("embedding", "head", f"block_{blocks - 1}"):
            out.add(c)
    return frozenset(into), frozenset(out)


def _block_runs(module: StageModule) -> list[sequence_parallel.Run]:
    """The stage's runs of consecutive blocks, chunk by chunk (the embedding and the head stay
    outside: they run on the whole sequence), each with whether it takes and gives the whole
    sequence (not where its end is a chunk's end in ``module.split_in`` / ``split_out``)."""
    runs: list[sequence_parallel.Run] = []
    for c, (lo, hi) in enumerate(module.spans):
        start, run = lo, list[nn.Module]()
        for i in range(lo, hi + 1):
            if i == hi or module.names[i] in ("embedding", "head"):
                if run:
                    sliced = not (start == lo and c in module.split_in)
                    gathered = not (i == hi and c in module.split_out)
                    runs.append(sequence_parallel.Run(run, sliced, gathered))
                start, run = i + 1, list[nn.Module]()
            else:
                run.append(module.layers[i])
    return runs


def _whole_names(block: nn.Module) -> set[str]:
    """The names of ``block``'s parameters that stay whole on every rank (norms, row-parallel
    biases): under sequence parallelism each rank feeds them only its tokens."""
    names: set[str] = set()
    for prefix, sub in block.named_modules():
        if isinstance(sub, ColumnParallelLinear):
            continue
        for name, _ in sub.named_parameters(recurse=False):
            if isinstance(sub, RowParallelLinear) and name == "weight":
                continue
            names.add(f"{prefix}.{name}" if prefix else name)
    return names


def _column(
    parent: nn.Module,
    name: str,
    group: dist.ProcessGroup | None,
    enters: bool = False,
    qkv: bool = False,
    seq: bool = False,
) -> None:
    full = parent.get_submodule(name)
    assert isinstance(full, nn.Linear)
    setattr(parent, name, ColumnParallelLinear(full, group, enters, qkv, seq))


def _row(parent: nn.Module, name: str, group: dist.ProcessGroup | None, seq: bool = False) -> None:
    full = parent.get_submodule(name)
    assert isinstance(full, nn.Linear)
    setattr(parent, name, RowParallelLinear(full, group, seq))
