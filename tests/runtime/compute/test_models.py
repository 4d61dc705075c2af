from __future__ import annotations

import pytest
import torch

from dmsc.netmodel.schedule import schedule_ops
from dmsc.runtime.compute.models.chain import build_stage, layer_names, loss_fn
from dmsc.spec import resolve_model

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
