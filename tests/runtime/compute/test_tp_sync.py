"""Where a tensor-parallel rank's flat vector sits in its replica's whole one
(:mod:`dmsc.runtime.compute.tp_sync`), without processes: cutting a whole vector gives each rank
the flat vector of its own shards (the reference: :func:`shard_state_dict` of the whole model),
the whole parameters are marked as the ranks' shared ones, and a checkpoint's round state of
another model is left out rather than cut wrong."""

from __future__ import annotations

import pytest
import torch

from dmsc.runtime.compute.models.chain import build_stage
from dmsc.runtime.compute.tensor_parallel import shard_state_dict, split_of
from dmsc.runtime.compute.tp_sync import ShardLayout, round_state_cut
from dmsc.spec import TransformerSpec, resolve_model


def _whole(name: str) -> tuple[TransformerSpec, dict[str, torch.Tensor]]:
    spec = resolve_model(name)
    assert isinstance(spec, TransformerSpec)
    spec = spec.model_copy(update={"layers": 2, "heads": 4, "kv_heads": 4})
    stage = build_stage(spec, 0, "embedding", "head")
    return spec, {n: p.detach() for n, p in stage.named_parameters()}


@pytest.mark.parametrize("name", ["gpt-mini", "llama-mini"])
@pytest.mark.parametrize("tp", [2, 4])
def test_cutting_a_whole_vector_gives_each_rank_its_shards(name: str, tp: int) -> None:
    spec, params = _whole(name)
    whole_flat = torch.cat([p.reshape(-1) for p in params.values()])
    for rank in range(tp):
        shards = shard_state_dict(spec, params, rank, tp)
        layout = ShardLayout(spec, shards.items(), rank, tp)
        want = torch.cat([shards[n].reshape(-1) for n in params])
        assert layout.whole_n == whole_flat.numel() and layout.n == want.numel()
        assert torch.equal(layout.cut(whole_flat), want)
        shared = sum(p.numel() for n, p in params.items() if split_of(spec, n) is None)
        assert int(layout.whole.sum()) == shared
        # the shared coordinates are the same on every rank: the whole model's
        shared_flat = torch.cat([p.reshape(-1) for n, p in params.items() if not split_of(spec, n)])
        assert torch.equal(layout.cut(whole_flat)[layout.whole], shared_flat)


def test_a_round_state_of_another_size_is_left_out() -> None:
    spec, params = _whole("gpt-mini")
    layout = ShardLayout(spec, shard_state_dict(spec, params, 1, 2).items(), 1, 2)
    held = {
        "dmsc.sync.anchor": torch.arange(layout.whole_n, dtype=torch.float32),
        "dmsc.sync.momentum": torch.zeros(layout.whole_n + 1),  # another model's
        "dmsc.sync.rounds": torch.tensor([3]),
    }
    cut = round_state_cut(layout, held)
    assert sorted(cut) == ["dmsc.sync.anchor", "dmsc.sync.rounds"]
    assert cut["dmsc.sync.anchor"].numel() == layout.n
    with pytest.raises(ValueError, match="a flat vector of"):
        layout.cut(torch.zeros(3))
