"""The learning rate of each step of a training task: linear warm-up, then constant, cosine or
linear decay to ``min_lr_ratio`` of the peak over the task's remaining steps (the schedules of
GPT-3 and Megatron-LM; cosine as in Loshchilov & Hutter, "SGDR", ICLR 2017, without restarts).

The control plane computes it (a pure function of the step's index in the task) and sends it
with each step's ``Commit``, so a step run again after a recovery gets the same rate, and the
workers' optimizers need no scheduler state in their checkpoints."""

from __future__ import annotations

import math

from dmsc.runtime.transport.messages import TrainSettings


def lr_at(i: int, steps: int, s: TrainSettings) -> float:
    """The learning rate of the ``i``-th step (from 0) of a task of ``steps`` steps."""
    peak, warm = s.lr, min(s.warmup_steps, steps)
    if i < warm:
        return peak * (i + 1) / warm
    if s.lr_schedule == "constant":
        return peak
    floor = peak * s.min_lr_ratio
    span = steps - warm  # the decay runs from the peak (index warm) to the floor (index steps)
    done = min(1.0, (i - warm) / span) if span > 0 else 1.0
    if s.lr_schedule == "linear":
        return peak + (floor - peak) * done
    return floor + (peak - floor) * (1 + math.cos(math.pi * done)) / 2
