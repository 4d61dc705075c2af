"""The learning-rate schedule against PyTorch's own schedulers stepping a real optimizer."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from dmsc.runtime.control.training.lr_schedule import lr_at
from dmsc.runtime.transport.messages import TrainSettings


def torch_lrs(steps: int, lr: float, warm: int, decay: str, floor: float) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    span = steps - warm
    if decay == "cosine":
        after = CosineAnnealingLR(opt, T_max=span, eta_min=lr * floor)
    elif decay == "linear":
        after = LinearLR(opt, start_factor=1.0, end_factor=floor, total_iters=span)
    else:
        after = LinearLR(opt, start_factor=1.0, end_factor=1.0, total_iters=1)
    sched = after
    if warm:
        first = LinearLR(opt, start_factor=1 / warm, end_factor=1.0, total_iters=warm - 1)
        sched = SequentialLR(opt, [first, after], milestones=[warm])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("decay", ["constant", "cosine", "linear"])
@pytest.mark.parametrize(
    "steps,warm,floor", [(20, 0, 0.0), (20, 5, 0.1), (7, 2, 0.0), (50, 10, 0.3)]
)
def test_schedule_matches_torch(decay: str, steps: int, warm: int, floor: float) -> None:
    s = TrainSettings(lr=3e-3, lr_schedule=decay, warmup_steps=warm, min_lr_ratio=floor)  # type: ignore[arg-type]
    ours = [lr_at(i, steps, s) for i in range(steps)]
    assert ours == pytest.approx(torch_lrs(steps, 3e-3, warm, decay, floor), rel=1e-9, abs=1e-12)


def test_warmup_reaches_the_peak_and_decay_ends_at_the_floor() -> None:
    s = TrainSettings(lr=1.0, lr_schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(i, 10, s) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(10, 10, s) == pytest.approx(0.1)
    assert lr_at(0, 1, TrainSettings(lr=0.5, warmup_steps=1)) == 0.5
