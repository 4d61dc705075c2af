"""Single-process training of the same model: the reference the pipeline is tested against."""

from __future__ import annotations

import torch

from dmsc.runtime.compute.models.chain import layer_names, loss_fn
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.spec import TransformerSpec


def train_reference(
    spec: TransformerSpec,
    seed: int,
    lr: float,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    microbatches: int | list[int],
    optimizer: str = "adamw",
) -> list[float]:
    """Losses of each step: the global batch split into ``microbatches`` (one count for all
    steps, or one per step), gradients accumulated, one AdamW (or plain SGD) step, exactly as
    the pipeline does it."""
    names = layer_names(spec)
    model = stage_module(spec, seed, names[0], names[-1])  # from its checkpoint when it has one
    opt = (
        torch.optim.SGD(model.parameters(), lr=lr)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=lr)
    )
    losses = []
    counts = microbatches if isinstance(microbatches, list) else [microbatches] * len(batches)
    for (tokens, targets), m in zip(batches, counts, strict=True):
        total = 0.0
        for x, y in zip(tokens.chunk(m), targets.chunk(m), strict=True):
            loss = loss_fn(model(x), y) / m
            loss.backward()
            total += float(loss.detach()) * m
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / m)
    return losses
