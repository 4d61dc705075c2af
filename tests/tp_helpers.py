"""Helpers shared by the tensor- and sequence-parallel tests against one process
(tests/runtime/compute/test_tensor_parallel.py, test_sequence_parallel.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.chain import StageModule
from dmsc.runtime.compute.outer_sync import make_optimizer
from dmsc.runtime.compute.vocab_parallel import stage_loss
from dmsc.spec import TransformerSpec, resolve_model

STEPS, SEED, LR = 10, 3, 3e-3


def small_spec(name: str) -> TransformerSpec:
    """The preset, two blocks deep (the first of moe-mini's blocks has experts)."""
    spec = resolve_model(name)
    assert isinstance(spec, TransformerSpec)
    return spec.model_copy(update={"layers": 2})


def batches(spec: TransformerSpec) -> list[torch.Tensor]:
    """Two batches of random tokens in turn: the loss falls as the model learns them."""
    gen = torch.Generator().manual_seed(11)
    two = [torch.randint(0, spec.vocab, (4, 33), generator=gen) for _ in range(2)]
    return [two[i % 2] for i in range(STEPS)]


def train(spec: TransformerSpec, module: StageModule) -> list[float]:
    optimizer = make_optimizer("adamw", module, LR)
    losses = []
    for tokens in batches(spec):
        loss = stage_loss(module, module(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def greedy(spec: TransformerSpec, module: StageModule, new: int = 8) -> list[int]:
    """Greedy decoding with the key/value cache: a prompt, then one token at a time."""
    tokens = batches(spec)[0][:1, :12]
    cache, out = StageCache(), []
    with torch.no_grad():
        logits = module(tokens, cache, 0)
        for _ in range(new):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            logits = module(torch.tensor([[nxt]]), cache, cache.length)
    return out


def two_ranks(
    rank_fn: Callable[[int, int, str], None], out: Path, names: tuple[str, ...]
) -> dict[str, list[dict[str, Any]]]:
    """``rank_fn(rank, port, out)`` in two spawned processes meeting at a store on ``port``;
    each name's record from each rank (``out/NAME-rankR.pt``)."""
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    with pytest.MonkeyPatch.context() as patch:
        # the spawned ranks import the test module by its name, with the parent's sys.path:
        # the repository's root on it
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        mp.spawn(rank_fn, args=(store.port, str(out)), nprocs=2, join=True)
    return {n: [torch.load(out / f"{n}-rank{r}.pt") for r in range(2)] for n in names}
