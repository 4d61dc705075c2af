"""A model as a chain of layers that any contiguous slice of can run as a stage (a micro-model),
or several slices apart from one another as the chunks of one interleaved stage.

The chain is ``embedding, block_0 .. block_{L-1}, head``: the names the cost model and the plan
use, for every family (:mod:`.gpt`, :mod:`.llama`). A model made from a seed is built whole in
every process from the same seed and sliced, so the stages of a pipeline hold exactly the
parameters single-process training would; a model loaded from a checkpoint builds only its slice
(on the meta device, then filled from the checkpoint: a stage never holds the whole model).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from dmsc.runtime.compute.models import gpt, llama
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.support import check_runnable
from dmsc.runtime.compute.models.support import layer_names as layer_names
from dmsc.spec import TransformerSpec


def build_layer(spec: TransformerSpec, index: int) -> nn.Module:
    """Layer ``index`` of the chain (0: embedding, 1..L: blocks, L+1: head), freshly initialised."""
    fam = gpt if spec.family == "gpt" else llama
    if index == 0:
        return gpt.Embedding(spec) if fam is gpt else llama.TokenEmbedding(spec)
    if index == spec.layers + 1:
        return fam.Head(spec)
    if fam is gpt:
        return gpt.Block(spec)
    return llama.Block(spec, moe=spec.is_moe_layer(index - 1))


class StageModule(nn.Module):
    """A contiguous slice of the chain: a micro-model; or, with ``spans``, the chunks of an
    interleaved stage (each a contiguous slice, ``layers[lo:hi]``), run one at a time. The
    layers are held once, in chain order, whatever their chunks: a checkpoint of the stage is
    that of its layers, as that of any other cut of the model."""

    def __init__(
        self,
        layers: list[nn.Module],
        names: list[str],
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.names = names
        self.spans = spans or [(0, len(layers))]
        # the chunks whose input (``split_in``) or output (``split_out``) frames hold this
        # rank's slice of the sequence while training under sequence parallelism (a block's
        # shard, from or to a block of another stage; :mod:`..sequence_parallel`); set when
        # the stage is split (``tensor_parallel.parallelize_stage``)
        self.split_in: frozenset[int] = frozenset()
        self.split_out: frozenset[int] = frozenset()

    @property
    def chunks(self) -> int:
        return len(self.spans)

    def chunk_first(self, chunk: int) -> bool:
        """Chunk ``chunk`` starts at the embedding (takes tokens)."""
        return self.names[self.spans[chunk][0]] == "embedding"

    def chunk_last(self, chunk: int) -> bool:
        """Chunk ``chunk`` ends at the head (gives logits)."""
        return self.names[self.spans[chunk][1] - 1] == "head"

    @property
    def is_first(self) -> bool:
        return self.names[0] == "embedding"

    @property
    def is_last(self) -> bool:
        return self.names[-1] == "head"

    def forward(
        self, x: torch.Tensor, cache: StageCache | None = None, start: int = 0, chunk: int = 0
    ) -> torch.Tensor:
        """This stage's layers (of ``chunk``) on ``x``; with a ``cache``, ``x`` holds positions
        ``start ..`` and the attention layers attend to, and extend, the session's kept keys
        and values (by the layer's index in the stage: chunks never share one)."""
        lo, hi = self.spans[chunk]
        for i in range(lo, hi):
            name, layer = self.names[i], self.layers[i]
            if name == "embedding":
                x = layer(x, start)
            elif name == "head":
                x = layer(x)
            else:
                x = layer(x, None if cache is None else cache.layer(i), start)
        if cache is not None:
            cache.length = start + x.shape[1]
        return x


def layer_range(spec: TransformerSpec, first: str, last: str) -> tuple[int, int]:
    """Chain indices ``[lo, hi)`` of the layers ``first`` .. ``last`` (inclusive, by name)."""
    names = layer_names(spec)
    if first not in names or last not in names:
        raise ValueError(f"unknown layer {first!r} or {last!r} (layers: {names[0]} .. {names[-1]})")
    lo, hi = names.index(first), names.index(last) + 1
    if lo >= hi:
        raise ValueError(f"empty layer range {first} .. {last}")
    return lo, hi


def chunk_spans(spec: TransformerSpec, ranges: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """Chain indices ``[lo, hi)`` of each of ``ranges`` (first and last layer, by name), which
    follow one another down the chain without overlapping; ValueError otherwise."""
    spans = [layer_range(spec, first, last) for first, last in ranges]
    for (_, hi), (lo, _) in itertools.pairwise(spans):
        if lo < hi:
            raise ValueError(f"chunks overlap or are out of order: {ranges}")
    return spans


def build_stage(
    spec: TransformerSpec,
    seed: int,
    first: str,
    last: str,
    *,
    empty: bool = False,
    chunks: list[tuple[str, str]] | None = None,
) -> StageModule:
    """The layers ``first`` .. ``last`` of the model built from ``seed`` (or those of each of
    ``chunks``: an interleaved stage); with ``empty``, only those layers, uninitialised (their
    storage allocated, for a checkpoint to fill)."""
    check_runnable(spec)
    spans = chunk_spans(spec, chunks or [(first, last)])
    index = [i for lo, hi in spans for i in range(lo, hi)]
    names = [layer_names(spec)[i] for i in index]
    local, at = [], 0
    for lo, hi in spans:
        local.append((at, at + hi - lo))
        at += hi - lo
    if empty:
        with torch.device("meta"):
            module = StageModule([build_layer(spec, i) for i in index], names, local)
        module = module.to_empty(device="cpu")
    else:
        torch.manual_seed(seed)
        chain = [build_layer(spec, i) for i in range(spec.layers + 2)]
        if spec.tied_embeddings:  # the head starts from the embedding, wherever each one runs
            _tie(chain[-1], chain[0])
        module = StageModule([chain[i] for i in index], names, local)
    if spec.tied_embeddings and module.is_first and module.is_last:
        _tie(module.layers[-1], module.layers[0])  # one tensor, as in transformers
    return module


def _tie(head: nn.Module, embedding: nn.Module) -> None:
    head.get_submodule("out").register_parameter("weight", embedding.get_parameter("tok.weight"))


def tied_weight(spec: TransformerSpec, module: StageModule) -> torch.nn.Parameter | None:
    """The embedding matrix this stage shares with a stage at the other end of the pipeline:
    the token embedding (first stage) or the head's projection (last stage) of a model with
    tied embeddings whose two ends run in different stages; None otherwise. The two copies
    start equal and add each other's gradient before every optimizer step (as Megatron-LM's
    embedding all-reduce does), so they stay equal."""
    if not spec.tied_embeddings or module.is_first == module.is_last:
        return None
    if module.is_first:
        return module.layers[0].get_parameter("tok.weight")
    return module.layers[-1].get_parameter("out.weight")


def loss_fn(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))
