"""A stage's linear weights cast once for decoding under autocast (a GPU stage's bf16), not at
every call: the same outputs bit for bit, fewer casts, the float32 masters kept.

On the CPU's autocast (bf16), which casts a linear layer's weight at every call as CUDA's does;
the reference is the same stage decoding with the per-call casts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dmsc.runtime.compute.decode_weights import DecodeCasts
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.spec import resolve_model

BF16 = torch.bfloat16


class _Casts(TorchDispatchMode):
    """Counts the casts to another dtype that run (``aten._to_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _decode(stage: nn.Module, ids: torch.Tensor, casts: DecodeCasts | None) -> list[torch.Tensor]:
    """A prompt, then three tokens one at a time, each forward under bf16 autocast (with
    ``casts`` applied if given), as a GPU stage decodes."""
    cache, outs, start = StageCache(), [], 0
    for piece in (ids[:, :5], ids[:, 5:6], ids[:, 6:7], ids[:, 7:8]):
        with torch.no_grad(), torch.autocast("cpu", BF16):
            if casts is None:
                outs.append(stage(piece, cache, start))
            else:
                with casts.applied():
                    outs.append(stage(piece, cache, start))
        start += piece.shape[1]
    return outs


@pytest.mark.parametrize("model", ["llama-mini", "gpt-mini"])
def test_a_stage_decodes_the_same_outputs_bit_for_bit_with_fewer_casts(model: str) -> None:
    spec = resolve_model(model)
    stage = build_stage(spec, 0, "embedding", "head")
    ids = torch.randint(0, spec.vocab, (1, 8), generator=torch.Generator().manual_seed(3))
    masters = {id(p): (p, p.data_ptr(), p.data.clone()) for p in stage.parameters()}
    casts = DecodeCasts(stage, BF16)
    cast = casts.params()
    assert cast and all(p.dtype == torch.float32 for p in cast)
    want = _decode(stage, ids, None)
    got = _decode(stage, ids, casts)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)  # autocast rounds a weight alike, per call or once
    # the masters back, the same objects and storage, unchanged
    for p in stage.parameters():
        obj, ptr, value = masters[id(p)]
        assert p is obj and p.data_ptr() == ptr and p.dtype == torch.float32
        assert torch.equal(p.data, value)
    # a token without the casts casts each such weight; with them, none of those
    one = ids[:, :1]
    with torch.no_grad(), torch.autocast("cpu", BF16):
        with _Casts() as per_call:
            stage(one, StageCache(), 0)
        with casts.applied(), _Casts() as once:
            stage(one, StageCache(), 0)
    assert per_call.count - once.count == len(cast)


def test_a_changed_master_is_cast_again_and_a_failed_step_restores_the_masters() -> None:
    layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    casts = DecodeCasts(layer, BF16)
    x = torch.randn(1, 4)
    with casts.applied():
        assert all(p.dtype == BF16 for p in casts.params())
        held = [layer[0].weight.data]  # kept alive: its memory is not handed out again
        first = held[0].data_ptr()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x).sum().backward()
    opt.step()  # the masters change in place
    with casts.applied():
        assert torch.equal(layer[0].weight.data, layer[0].weight.detach().to(BF16))
        assert layer[0].weight.data_ptr() != first  # cast again
    with casts.applied():
        held.append(layer[0].weight.data)
        same = held[-1].data_ptr()
    with casts.applied():
        assert layer[0].weight.data_ptr() == same  # unchanged since: the cast kept
    with pytest.raises(RuntimeError, match="boom"), casts.applied():
        raise RuntimeError("boom")
    assert all(p.dtype == torch.float32 for p in layer.parameters())
    casts.clear()
    with casts.applied():
        assert layer[0].weight.data_ptr() != same  # forgotten: cast anew


def test_a_weight_held_by_another_kind_of_module_is_left_in_float32() -> None:
    """A head tied to the embedding table: the table's lookup is no autocast op, and a bf16
    table would change what it returns."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.proj = nn.Linear(4, 4)

    m = Tied()
    cast = DecodeCasts(m, BF16).params()
    assert all(p is not m.embed.weight for p in cast)
    assert {id(p) for p in cast} == {id(m.proj.weight), id(m.proj.bias)}
    assert DecodeCasts(m, torch.float32).params() == []  # already in that precision
