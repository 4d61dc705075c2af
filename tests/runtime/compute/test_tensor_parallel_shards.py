"""How :mod:`dmsc.runtime.compute.tensor_parallel` cuts a state dict, without processes: the
shards put back together are the whole, GPT's fused q, k, v give each rank its own heads' rows
of all three, and a model ``tp`` cannot share evenly is refused naming the shape."""

from __future__ import annotations

import pytest
import torch

from dmsc.netmodel.layers import padded_vocab
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.runtime.compute.tensor_parallel import shard_state_dict, split_of, unshard
from dmsc.spec import TransformerSpec, resolve_model


def _spec(name: str, **update: int) -> TransformerSpec:
    spec = resolve_model(name)
    assert isinstance(spec, TransformerSpec)
    return spec.model_copy(update={"layers": 2, **update})


@pytest.mark.parametrize("name", ["gpt-mini", "llama-mini", "moe-mini"])
@pytest.mark.parametrize("tp", [2, 4])
def test_the_shards_put_back_together_are_the_whole(name: str, tp: int) -> None:
    spec = _spec(name, heads=4, kv_heads=4) if tp == 4 else _spec(name)
    full = build_stage(spec, 0, "embedding", "head").state_dict()
    shards = [shard_state_dict(spec, full, r, tp) for r in range(tp)]
    for key, tensor in full.items():
        split = split_of(spec, key)
        if split is None:
            assert all(s[key] is tensor for s in shards), key
            continue
        sizes = {s[key].numel() for s in shards}
        assert len(sizes) == 1, key  # an equal share each
        if split == "vocab":  # the vocabulary's rows, padded as the cost model pads them
            assert sizes.pop() * tp == padded_vocab(spec.vocab, tp) * spec.hidden, key
        else:
            assert sizes.pop() * tp == tensor.numel(), key
        assert torch.equal(unshard([s[key] for s in shards], split, spec.vocab), tensor), key


def test_a_gpt_rank_holds_q_k_and_v_of_its_own_heads() -> None:
    spec = _spec("gpt-mini")
    full = build_stage(spec, 0, "embedding", "head").state_dict()
    H, half = spec.hidden, spec.hidden // 2
    whole = full["layers.1.qkv.weight"]
    q, k, v = whole[:H], whole[H : 2 * H], whole[2 * H :]
    for rank in range(2):
        mine = shard_state_dict(spec, full, rank, 2)["layers.1.qkv.weight"]
        rows = slice(rank * half, (rank + 1) * half)
        assert torch.equal(mine, torch.cat([q[rows], k[rows], v[rows]]))


def test_a_tp_that_does_not_divide_the_heads_is_refused() -> None:
    spec = _spec("llama-mini")  # 4 heads, 2 key/value heads
    full = build_stage(spec, 0, "embedding", "head").state_dict()
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's kv_heads \(2\)"):
        shard_state_dict(spec, full, 0, 4)
