"""Single-process training of the same model: the reference the pipeline is tested against."""

from __future__ import annotations

import copy

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


def train_diloco_reference(
    spec: TransformerSpec,
    seed: int,
    lr: float,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    microbatches: int,
    replicas: int,
    inner_steps: int,
    outer_lr: float,
    outer_momentum: float,
) -> list[float]:
    """DiLoCo in one process, the reference of the replicas' rounds: each replica a copy of the
    model with its own AdamW, trained on its share of every batch (``microbatches`` each);
    after every ``inner_steps`` steps (and the last) the outer SGD step with Nesterov momentum
    on the mean of ``anchor - weights``, every copy set to the new anchor. Returns each step's
    loss (the mean over the replicas)."""
    names = layer_names(spec)
    base = stage_module(spec, seed, names[0], names[-1])
    models = [copy.deepcopy(base) for _ in range(replicas)]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m in models]
    anchor = [p.detach().clone() for p in base.parameters()]
    momentum = [torch.zeros_like(p) for p in anchor]
    losses = []
    for step, (tokens, targets) in enumerate(batches):
        total = 0.0
        shares = zip(models, opts, tokens.chunk(replicas), targets.chunk(replicas), strict=True)
        for model, opt, xr, yr in shares:
            for x, y in zip(xr.chunk(microbatches), yr.chunk(microbatches), strict=True):
                loss = loss_fn(model(x), y) / microbatches
                loss.backward()
                total += float(loss.detach()) / replicas
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total)
        if (step + 1) % inner_steps == 0 or step == len(batches) - 1:
            with torch.no_grad():
                params = [list(m.parameters()) for m in models]
                for i, a in enumerate(anchor):
                    delta = sum(a - ps[i] for ps in params) / replicas
                    momentum[i].mul_(outer_momentum).add_(delta)
                    a -= outer_lr * (delta + outer_momentum * momentum[i])
                    for ps in params:
                        ps[i].copy_(a)
    return losses
