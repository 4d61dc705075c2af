"""The pipeline executor: one step's schedule of forward and backward ops at one stage.

A training step runs GPipe or 1F1B over the step's micro-batches (the order comes from
:func:`dmsc.netmodel.schedule.schedule_ops`, the same one the cost model replays); evaluation and
inference run the forwards only. Inputs come from the inbox through :class:`Peers`, outputs go
straight to the neighbouring stage; the last stage computes the loss (scaled by the number of
micro-batches, so that the gradients add up to those of the whole batch) or, for inference, keeps
the logits of every sequence's last position. Gradients stay in the module: averaging them
between replicas and applying them are the server's business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dmsc.netmodel.schedule import schedule_ops
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.chain import StageModule, loss_fn
from dmsc.runtime.compute.peers import Peers
from dmsc.runtime.transport.wire import Kind

Op = tuple[str, int]  # ("F" or "B", micro-batch)


@dataclass
class StepOutcome:
    """What one stage's part of a step produced."""

    compute_s: float = 0.0  # forward and backward time, waiting excluded
    losses: dict[int, float] = field(default_factory=dict)  # per micro-batch (last stage)
    logits: list[torch.Tensor] = field(default_factory=list)  # last position (inference)
    # (op, micro-batch, start, end): each op's compute, wall-clock seconds (time.time(), so
    # that the stages' spans line up in one Gantt chart on one machine's clock)
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)


def step_ops(schedule: str, stage: int, stages: int, microbatches: int, train: bool) -> list[Op]:
    """The ops of one step at ``stage``: the schedule's when training, forwards otherwise."""
    if train:
        return schedule_ops(schedule, stage, stages, microbatches)
    return [("F", i) for i in range(microbatches)]


def run_ops(
    module: StageModule,
    peers: Peers,
    stage: int,
    step: int,
    ops: list[Op],
    microbatches: int,
    train: bool,
    evaluate: bool = False,
    cache: StageCache | None = None,
    start: int = 0,
    autocast: torch.dtype | None = None,
) -> StepOutcome:
    """Run ``ops`` of ``step`` at ``stage`` and wait for every send (:meth:`Peers.flush`);
    inference with an inference session's ``cache`` runs positions ``start ..`` only. The
    forwards run under ``autocast`` (a lower precision) when one is given."""
    m, out = microbatches, StepOutcome()
    device = next(module.parameters()).device
    gpu = device.type == "cuda"
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    module.train(train)
    for op, i in ops:
        if op == "F":
            if module.is_first:
                x = peers.recv(Kind.TOKENS, step, i)
            else:
                x = peers.recv(Kind.ACTIVATION, step, i)
                x.requires_grad_(train)
            c0, w0 = time.perf_counter(), time.time()
            with (
                torch.set_grad_enabled(train),
                torch.autocast(device.type, autocast or torch.float32, enabled=bool(autocast)),
            ):
                y = module(x) if cache is None else module(x, cache, start)
            if module.is_last and (train or evaluate):
                targets = peers.recv(Kind.TARGETS, step, i)
                with torch.set_grad_enabled(train):
                    loss = loss_fn(y.float(), targets) / m
                out.losses[i] = float(loss.detach()) * m
                y = loss
            if gpu:  # kernels run asynchronously: compute is over when the device is done
                torch.cuda.synchronize(device)
            out.compute_s += _span(out, "F", i, c0, w0)
            if train:
                inputs[i], outputs[i] = x, y
            if module.is_last and not train and not evaluate:
                out.logits.append(y[:, -1, :].detach().float())
            if not module.is_last:
                peers.send(stage + 1, Kind.ACTIVATION, step, i, y)
        else:
            grad = None
            if not module.is_last:  # wait for the gradient first: waiting is not compute
                grad = peers.recv(Kind.GRADIENT, step, i)
            c0, w0 = time.perf_counter(), time.time()
            outputs[i].backward(grad)
            if gpu:
                torch.cuda.synchronize(device)
            out.compute_s += _span(out, "B", i, c0, w0)
            if not module.is_first:
                grad_in = inputs[i].grad
                assert grad_in is not None
                peers.send(stage - 1, Kind.GRADIENT, step, i, grad_in)
            del inputs[i], outputs[i]
    peers.flush()
    return out


def _span(out: StepOutcome, op: str, mb: int, c0: float, w0: float) -> float:
    """Record the op that began at ``c0`` (``perf_counter``) and ``w0`` (``time.time``);
    returns its duration."""
    took = time.perf_counter() - c0
    out.spans.append((op, mb, w0, w0 + took))
    return took
