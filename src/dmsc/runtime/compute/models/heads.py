"""A business-segmented model: one shared backbone and several task heads, each a micro-model.

``dmsc segment --method business`` cuts a model into a backbone and one micro-model per task
head; this module builds and trains such a model from a :class:`~dmsc.spec.TransformerSpec`, so
that the heads' outputs can be combined at inference
(:mod:`dmsc.runtime.control.serving.combiners`).

- The backbone is the chain's first layers, ``embedding .. block_{b-1}``; each head is the rest,
  ``block_b .. head``, with its own parameters (built from its own seed, or read from the spec's
  checkpoint: every head starts from the same pretrained weights there). A head is thus a whole
  task branch with its own blocks and output layer, as the seed describes business segmentation
  ("each have task-specific output or fine-tuning layers"), rather than a small MLP on the last
  hidden state: a branch with blocks of its own can specialise to its data, which is what makes
  the heads disagree and combining them worth it. ``b`` can be 0 (the backbone is only the
  embedding) up to the number of blocks (the heads are only the output layer).
- Every head predicts the next byte (the spec's vocabulary): the same label space, so the
  heads' probabilities can be voted on or averaged.
- :func:`train_heads` trains them the way separate sites would: head ``k`` sees only shard ``k``
  of the text (:func:`shard_text`: contiguous parts of the training text, which are different
  source files, so the data is skewed), and the backbone is trained jointly by all of them. One
  step draws a batch from every shard, runs it through the backbone and its own head, and
  averages the heads' losses: the backbone's gradient is the mean of the sites' gradients, what
  synchronous data parallelism over the sites would apply, while each head's gradient comes from
  its own site alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dmsc.data.corpus import Corpus
from dmsc.runtime.compute.models.chain import StageModule, layer_names, loss_fn
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.spec import TransformerSpec


class MultiHeadModel(nn.Module):
    """A backbone micro-model and ``K`` task-head micro-models over its hidden state."""

    def __init__(self, backbone: StageModule, heads: Sequence[StageModule]) -> None:
        super().__init__()
        if not heads:
            raise ValueError("a multi-head model needs at least one head")
        self.backbone = backbone
        self.heads = nn.ModuleList(heads)

    def forward(self, x_BT: torch.Tensor) -> list[torch.Tensor]:
        """Every head's next-token logits ``[B, T, V]`` for the tokens ``x_BT``."""
        h_BTD = self.backbone(x_BT)
        return [head(h_BTD) for head in self.heads]

    @torch.no_grad()
    def head_probs(self, x_BT: torch.Tensor) -> list[torch.Tensor]:
        """Every head's next-token probabilities, flattened to ``[B*T, V]`` (what the
        aggregation combines)."""
        return [
            torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), -1) for logits in self(x_BT)
        ]


def build_heads(
    spec: TransformerSpec, heads: int, backbone_blocks: int, seed: int = 0
) -> MultiHeadModel:
    """The backbone ``embedding .. block_{backbone_blocks-1}`` built from ``seed`` and ``heads``
    heads ``block_{backbone_blocks} .. head``, head ``k`` built from ``seed + 1 + k`` (so the
    heads start apart), or all loaded from the spec's checkpoint when it has one."""
    if heads < 1:
        raise ValueError(f"heads: {heads}; a multi-head model needs at least one")
    if not 0 <= backbone_blocks <= spec.layers:
        raise ValueError(
            f"backbone_blocks: {backbone_blocks}; the model has {spec.layers} blocks "
            f"(0 .. {spec.layers})"
        )
    names = layer_names(spec)
    split = backbone_blocks + 1  # chain index of the heads' first layer
    backbone = stage_module(spec, seed, names[0], names[split - 1])
    branches = [stage_module(spec, seed + 1 + k, names[split], names[-1]) for k in range(heads)]
    return MultiHeadModel(backbone, branches)


def shard_text(data: bytes, shards: int) -> list[bytes]:
    """``data`` cut into ``shards`` contiguous parts of equal length (the last takes the rest):
    with the standard library's text, each part holds different modules."""
    if shards < 1:
        raise ValueError(f"shards: {shards}; at least one")
    size = len(data) // shards
    if size == 0:
        raise ValueError(f"{len(data)} bytes cannot make {shards} shards")
    return [data[k * size : (k + 1) * size if k < shards - 1 else len(data)] for k in range(shards)]


def train_heads(
    model: MultiHeadModel,
    shards: Sequence[bytes],
    steps: int,
    batch: int,
    seq: int,
    lr: float = 1e-3,
    seed: int = 0,
) -> list[float]:
    """Train ``model`` for ``steps`` steps, head ``k`` on ``shards[k]`` only and the backbone on
    all of them (module docstring), with AdamW at ``lr``; ``batch`` windows of ``seq`` bytes per
    shard and step, drawn with ``seed``. Returns the mean of the heads' losses at each step."""
    if len(shards) != len(model.heads):
        raise ValueError(f"{len(shards)} shards for {len(model.heads)} heads: one shard per head")
    corpora = [Corpus(shard, seq, seed=seed * 1_000 + k) for k, shard in enumerate(shards)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        xs, ys = zip(*(corpus.batch(step, batch) for corpus in corpora), strict=True)
        # one backbone pass over every site's batch (the same as one pass per site: nothing
        # mixes across sequences), then each head on its own site's part
        h_parts = model.backbone(torch.cat(xs)).split(batch)
        loss = sum(
            (loss_fn(head(h), y) for head, h, y in zip(model.heads, h_parts, ys, strict=True)),
            start=torch.zeros(()),
        ) / len(corpora)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def held_out(data: bytes, seq: int, windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``windows`` non-overlapping (tokens, next tokens) windows of ``seq`` bytes spread evenly
    over ``data``: a fixed evaluation set, ``[windows, seq]`` each."""
    stride = (len(data) - 1) // windows
    if stride < seq:
        raise ValueError(f"{len(data)} bytes hold fewer than {windows} windows of {seq + 1}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    starts = [i * stride for i in range(windows)]
    x = torch.stack([tokens[s : s + seq] for s in starts])
    y = torch.stack([tokens[s + 1 : s + seq + 1] for s in starts])
    return x, y
