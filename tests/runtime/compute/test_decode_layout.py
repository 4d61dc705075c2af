"""The decoding layout of a CPU stage's weights: chosen per shape by timing, values unchanged,
put back as built for training."""

from __future__ import annotations

import torch
from torch import nn

from dmsc.runtime.compute.decode_layout import (
    DecodeLayout,
    choose,
    column_major,
    is_column_major,
    pass_s,
)
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.spec import resolve_model


def wide_is_faster(ws: list[torch.Tensor]) -> float:
    """A timer where column-major is twice as fast for weights with more outputs than inputs
    (and slower otherwise): deterministic, unlike the clock."""
    w = ws[0]
    wide = w.shape[0] > w.shape[1]
    return (1.0 if is_column_major(w) else 2.0) if wide else (2.0 if is_column_major(w) else 1.0)


def test_choose_takes_column_major_only_where_it_is_faster_by_the_margin() -> None:
    timings = {(8, 4): (1.0, 0.5), (4, 8): (1.0, 1.2), (6, 6): (1.0, 0.95), (5, 5): (1.0, 0.9)}
    assert choose(timings, margin=0.1) == {(8, 4): True, (4, 8): False, (6, 6): False, (5, 5): True}


def test_column_major_keeps_the_values_and_the_shape() -> None:
    w = torch.randn(6, 4)
    c = column_major(w)
    assert torch.equal(c, w) and c.shape == w.shape
    assert is_column_major(c) and not is_column_major(w) and not c.is_contiguous()


def test_the_real_timer_times_one_row_by_each_weight() -> None:
    assert 0.0 < pass_s([torch.randn(64, 32), torch.randn(64, 32)], rounds=2) < 1.0


def test_a_stage_decodes_the_same_logits_in_either_layout_and_trains_as_built() -> None:
    spec = resolve_model("llama-mini")
    stage = build_stage(spec, 0, "embedding", "head")
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    params = {id(p) for p in stage.parameters()}
    ids = torch.randint(0, spec.vocab, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        row = stage(ids, StageCache(), 0)
    layout = DecodeLayout(stage, timer=wide_is_faster)
    assert layout.describe() == "as built (row-major)"
    assert layout.use(decode=True) and layout.on
    linears = [m for m in stage.modules() if isinstance(m, nn.Linear)]
    for m in linears:  # wide weights column by column, the others as built
        assert is_column_major(m.weight) == (m.weight.shape[0] > m.weight.shape[1])
    assert {id(p) for p in stage.parameters()} == params  # the optimizer's parameters stay
    assert layout.columns is not None and any(layout.columns.values())
    assert "column-major" in layout.describe() and "row-major" in layout.describe()
    with torch.no_grad():
        col = stage(ids, StageCache(), 0)
    torch.testing.assert_close(col, row, rtol=1e-5, atol=1e-5)  # float32 rounding only
    assert not layout.use(decode=True)  # already laid out
    assert layout.use(decode=False) and not layout.on
    assert all(m.weight.is_contiguous() for m in linears)
    after = stage.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # bit for bit


def test_a_module_without_cpu_linear_weights_is_left_alone() -> None:
    layout = DecodeLayout(nn.Sequential(nn.ReLU()), timer=wide_is_faster)
    assert not layout.applicable and not layout.use(decode=True) and layout.columns is None
    on_meta = DecodeLayout(nn.Linear(4, 8, device="meta"), timer=wide_is_faster)
    assert not on_meta.applicable and not on_meta.use(decode=True)


def test_a_stage_that_trained_recently_decodes_as_built() -> None:
    """Inference between a task's training steps: no copies both ways a request."""
    from dmsc.runtime.compute import decode_layout

    now = [100.0]
    stage = build_stage(resolve_model("llama-mini"), 0, "embedding", "head")
    layout = DecodeLayout(stage, timer=wide_is_faster, clock=lambda: now[0])
    assert layout.use(decode=True)  # never trained: laid out at once
    assert layout.use(decode=False)  # a training step: back as built
    now[0] += decode_layout.QUIET_S - 1
    assert not layout.use(decode=True) and not layout.on
    assert all(p.is_contiguous() for p in stage.parameters())
    now[0] += 2
    assert layout.use(decode=True) and layout.on  # quiet long enough
