from __future__ import annotations

import pytest
import torch

from dmsc.netmodel.schedule import schedule_ops
from dmsc.runtime.compute.models.chain import build_stage, layer_names, loss_fn
from dmsc.spec import TransformerSpec, resolve_model

SPEC = resolve_model("gpt-mini")


def test_slices_compose_to_the_whole_model() -> None:
    names = layer_names(SPEC)
    whole = build_stage(SPEC, 3, names[0], names[-1])
    parts = [
        build_stage(SPEC, 3, "embedding", "block_1"),
        build_stage(SPEC, 3, "block_2", "block_2"),
        build_stage(SPEC, 3, "block_3", "head"),
    ]
    x = torch.randint(0, 256, (2, SPEC.seq))
    y = x
    for p in parts:
        y = p(y)
    assert torch.equal(whole(x), y)
    assert parts[0].is_first and parts[2].is_last and not parts[1].is_first
    n_params = sum(p.numel() for part in parts for p in part.parameters())
    assert n_params == sum(p.numel() for p in whole.parameters())


def test_bad_ranges() -> None:
    with pytest.raises(ValueError, match="unknown layer"):
        build_stage(SPEC, 0, "embedding", "block_9")
    with pytest.raises(ValueError, match="empty"):
        build_stage(SPEC, 0, "block_2", "block_1")
    with pytest.raises(ValueError, match="Llama family"):
        build_stage(SPEC.model_copy(update={"experts": 2}), 0, "embedding", "head")
    with pytest.raises(ValueError, match="dropout"):
        build_stage(SPEC.model_copy(update={"dropout": 0.1}), 0, "embedding", "head")


def test_loss_at_init_is_near_uniform() -> None:
    model = build_stage(SPEC, 0, "embedding", "head")
    x = torch.randint(0, 256, (4, SPEC.seq))
    assert abs(float(loss_fn(model(x), x).detach()) - torch.log(torch.tensor(256.0)).item()) < 0.5


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_schedules_cover_every_microbatch_in_order(stages: int, m: int) -> None:
    for s in range(stages):
        for name in ("gpipe", "1f1b"):
            ops = schedule_ops(name, s, stages, m)
            assert [i for op, i in ops if op == "F"] == list(range(m))
            assert [i for op, i in ops if op == "B"] == list(range(m))
            # A backward never comes before its own forward.
            assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))
    # 1F1B keeps at most (stages - stage) micro-batches in flight.
    ops = schedule_ops("1f1b", 0, stages, m)
    inflight = peak = 0
    for op, _ in ops:
        inflight += 1 if op == "F" else -1
        peak = max(peak, inflight)
    assert peak == min(m, stages)


@pytest.mark.parametrize("preset", ["gpt-mini", "llama-mini", "moe-mini"])
def test_a_kv_cache_session_gives_the_logits_of_the_whole_sequence(preset: str) -> None:
    """Prefill, then one token at a time and a chunk of three, through two stages that keep
    their keys and values: the logits of every position equal one forward of the whole."""
    from dmsc.runtime.compute.models.attention import StageCache

    spec = resolve_model(preset)
    assert isinstance(spec, TransformerSpec)
    stages = [build_stage(spec, 5, "embedding", "block_1"), build_stage(spec, 5, "block_2", "head")]
    x = torch.randint(0, spec.vocab, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = stages[1](stages[0](x))
        caches = [StageCache(), StageCache()]
        got, start = [], 0
        for size in (8, 1, 1, 3, 1, 6):
            h = x[:, start : start + size]
            for stage, cache in zip(stages, caches, strict=True):
                h = stage(h, cache, start)
            got.append(h)
            start += size
    assert start == 20 and caches[1].length == 20 and caches[0].nbytes > 0
    assert torch.allclose(torch.cat(got, dim=1), whole, atol=1e-5)


def test_rotary_tables_of_a_decoding_session_equal_those_computed_afresh() -> None:
    """The frequencies are computed once per device; every position's cos and sin stay what a
    fresh computation gives, bit for bit (a decoding step asks for a new position each time)."""
    from dmsc.runtime.compute.models.llama import Rotary, rotary_inv_freq

    spec = resolve_model("llama-mini")
    assert isinstance(spec, TransformerSpec)
    rotary = Rotary(spec)
    for start, T in [(0, 32), *((32 + k, 1) for k in range(20)), (3, 5)]:
        cos, sin = rotary(start, T, torch.device("cpu"))
        inv = rotary_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        freqs = torch.outer(torch.arange(start, start + T, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())
