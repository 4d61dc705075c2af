"""The pipeline executor: one step's schedule of forward and backward ops at one stage.

A training step runs GPipe or 1F1B over the step's micro-batches, or the interleaved 1F1B of a
stage holding several model chunks (the order comes from
:func:`dmsc.netmodel.schedule.stage_order`, the same one the cost model replays); evaluation and
inference run the forwards only (in the interleaved schedule's order of chunks).

An interleaved pipeline of ``p`` stages and ``v`` chunks each is a pipeline of ``p v`` virtual
stages: chunk ``c`` of stage ``s`` is virtual stage ``c p + s``, whose output goes to virtual
stage ``c p + s + 1`` (stage ``s + 1``, or from the last stage to chunk ``c + 1`` of stage 0)
and whose input gradient goes back the same way. A frame for chunk ``c`` carries micro-batch
``c m + i`` (``m`` micro-batches), so that a stage tells its chunks' frames apart; with one
chunk that is the micro-batch itself. Inputs come from the inbox through :class:`Peers`, outputs go
straight to the neighbouring stage; the last stage computes the loss (scaled by the number of
micro-batches, so that the gradients add up to those of the whole batch) or, for inference, keeps
the logits of every sequence's last position. Gradients stay in the module: averaging them
between replicas and applying them are the server's business.
"""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec

import torch

from dmsc.netmodel.schedule import chunk_table, stage_order
from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.chain import StageModule
from dmsc.runtime.compute.peers import Peers
from dmsc.runtime.compute.pp_shards import shard, whole
from dmsc.runtime.compute.vocab_parallel import stage_loss
from dmsc.runtime.transport.wire import Kind

Op = tuple[str, int, int]  # ("F" or "B", micro-batch, chunk)


@dataclass
class StepOutcome:
    """What one stage's part of a step produced."""

    compute_s: float = 0.0  # forward and backward time, waiting excluded
    losses: dict[int, float] = field(default_factory=dict)  # per micro-batch (last stage)
    logits: list[torch.Tensor] = field(default_factory=list)  # last position (inference)
    handed: torch.Tensor | None = None  # the output a chained inference step hands on (.relay)
    # (op, micro-batch, start, end): each op's compute, wall-clock seconds (time.time(), so
    # that the stages' spans line up in one Gantt chart on one machine's clock)
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)


def step_ops(
    schedule: str, stage: int, stages: int, microbatches: int, train: bool, chunks: int = 1
) -> list[Op]:
    """The ops of one step at ``stage`` (holding ``chunks`` model chunks): the schedule's when
    training (interleaved 1F1B with several chunks, which GPipe is not), forwards otherwise."""
    if chunks > 1 and schedule == "gpipe":
        raise ValueError(f"{chunks} model chunks run the interleaved 1F1B schedule, not gpipe")
    if train:
        return stage_order(schedule, stage, stages, microbatches, chunks)
    return [("F", i, c) for i, c in chunk_table(stages, microbatches, chunks)]


def hop(stage: int, stages: int, chunk: int, step: int) -> tuple[int, int]:
    """The (stage, chunk) ``step`` virtual stages away from chunk ``chunk`` of ``stage``
    (``+1``: where its output goes; ``-1``: where its input gradient goes)."""
    k = chunk * stages + stage + step
    return k % stages, k // stages


P = ParamSpec("P")
Runner = Callable[Concatenate[StageModule, Peers, P], "StepOutcome"]


def _tells_peers_of_failure(run: Runner[P]) -> Runner[P]:
    """``run``, telling ``peers`` when it fails (:meth:`Peers.step_failed`: a pipeline's gloo
    group is dropped, so the recovery's next epoch forms a new one)."""

    @functools.wraps(run)
    def running(
        module: StageModule, peers: Peers, /, *args: P.args, **kwargs: P.kwargs
    ) -> StepOutcome:
        try:
            return run(module, peers, *args, **kwargs)
        except BaseException as exc:
            peers.step_failed(str(exc) or type(exc).__name__)
            raise

    return running


@_tells_peers_of_failure
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
    stages: int = 1,
    hand_on: bool = False,
) -> StepOutcome:
    """Run ``ops`` of ``step`` at ``stage`` (of ``stages``) and wait for every send
    (:meth:`Peers.flush`); inference with an inference session's ``cache`` runs positions
    ``start ..`` only. The forwards run under ``autocast`` (a lower precision) when one is
    given. A training step without a deadline sends its activations and gradients over the
    pipeline's streams or gloo group where it has them (:mod:`.pipe_stream`,
    :mod:`.pipe_group`); the other steps over gRPC.
    With ``hand_on`` (a chained inference step) the activations are kept in the outcome for
    the caller to hand to the next stage itself (:mod:`.relay`), not sent."""
    peers.direct = train and peers.deadline is None
    METER.take()  # a new step: what an abandoned one left on the meter is not its
    m, out = microbatches, StepOutcome()
    device = next(module.parameters()).device
    gpu = device.type == "cuda"
    inputs: dict[tuple[int, int], torch.Tensor] = {}  # by (micro-batch, chunk)
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    if module.training != train:  # recursing over every submodule cost 0.3-0.8 ms a token
        module.train(train)
    p = stages
    for op, i, c in ops:
        tag = c * m + i  # the frame's micro-batch field for this chunk's frames
        if op == "F":
            if module.chunk_first(c):
                x = peers.recv(Kind.TOKENS, step, i)
            else:
                with METER.timed("pp"):  # waiting for the stage before: the pipeline's
                    x = peers.recv(Kind.ACTIVATION, step, tag, hop(stage, p, c, -1)[0])
                    if not (train and c in module.split_in):  # else the sequence's slice
                        x = whole(x, peers.tp)  # the ranks' slices (:mod:`.pp_shards`)
                x.requires_grad_(train)
            c0, w0 = time.perf_counter(), time.time()
            with (
                torch.set_grad_enabled(train),
                torch.autocast(device.type, autocast or torch.float32, enabled=bool(autocast)),
            ):
                y = module(x, cache, start if cache is not None else 0, c)
            last = module.chunk_last(c)
            if last and (train or evaluate):
                targets = peers.recv(Kind.TARGETS, step, i)
                with torch.set_grad_enabled(train):
                    loss = stage_loss(module, y.float(), targets) / m
                out.losses[i] = float(loss.detach()) * m
                y = loss
            if gpu:  # kernels run asynchronously: compute is over when the device is done
                torch.cuda.synchronize(device)
            out.compute_s += _span(out, "F", i, c0, w0)
            if train:
                inputs[(i, c)], outputs[(i, c)] = x, y
            if last and not train and not evaluate:
                out.logits.append(y[:, -1, :].detach().float())
            if not last and hand_on:
                out.handed = shard(y.detach(), peers.tp, peers.tp_rank)
            elif not last:
                to, tc = hop(stage, p, c, 1)
                if not (train and c in module.split_out):
                    y = shard(y, peers.tp, peers.tp_rank)
                peers.send(to, Kind.ACTIVATION, step, tc * m + i, y)
        else:
            grad = None
            if not module.chunk_last(c):  # wait for the gradient first: waiting is not compute
                with METER.timed("pp"):
                    grad = peers.recv(Kind.GRADIENT, step, tag, hop(stage, p, c, 1)[0])
                    if c not in module.split_out:
                        grad = whole(grad, peers.tp)
            c0, w0 = time.perf_counter(), time.time()
            outputs[(i, c)].backward(grad)
            if gpu:
                torch.cuda.synchronize(device)
            out.compute_s += _span(out, "B", i, c0, w0)
            if not module.chunk_first(c):
                grad_in = inputs[(i, c)].grad
                assert grad_in is not None
                if c not in module.split_in:
                    grad_in = shard(grad_in, peers.tp, peers.tp_rank)
                to, tc = hop(stage, p, c, -1)
                peers.send(to, Kind.GRADIENT, step, tc * m + i, grad_in)
            del inputs[(i, c)], outputs[(i, c)]
    f0 = time.perf_counter()
    peers.flush()
    if stages > 1:  # this stage's sends still on their way
        METER.add("pp", time.perf_counter() - f0)
    return out


def _span(out: StepOutcome, op: str, mb: int, c0: float, w0: float) -> float:
    """Record the op that began at ``c0`` (``perf_counter``) and ``w0`` (``time.time``);
    returns its duration."""
    took = time.perf_counter() - c0
    out.spans.append((op, mb, w0, w0 + took))
    return took


def logits_reply(rows: torch.Tensor, top: int | None = None) -> dict[str, Any]:
    """What the last stage answers an inference step with: each row's next-token logits
    (``rows``: rows x vocabulary), float32 in base64 (as JSON numbers a 32k row took a tenth of a
    token's time); with ``top``, only each row's ``top`` largest and their token ids (int64, in
    ``logit_ids``), which is all greedy (``top`` 1: the first largest, as ``argmax`` picks it)
    and top-k sampling read, so a decoded token ships k numbers instead of the vocabulary."""
    rows = rows.detach().float().cpu()
    if top is not None and top == 1:
        ids = rows.argmax(-1, keepdim=True)
        rows = rows.gather(-1, ids)
    elif top is not None and top < rows.shape[-1]:
        rows, ids = rows.topk(top, -1)
    else:
        ids = None
    out: dict[str, Any] = {
        "logits_shape": list(rows.shape),
        "logits": base64.b64encode(rows.contiguous().numpy().tobytes()).decode(),
    }
    if ids is not None:
        out["logit_ids"] = base64.b64encode(ids.contiguous().numpy().tobytes()).decode()
    return out
