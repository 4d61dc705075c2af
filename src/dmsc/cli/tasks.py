"""The work a running deployment does for the user: ``dmsc train`` and ``dmsc infer``, each one
call to the control plane (which queues it as a task and survives failed workers); the tasks'
records are :mod:`dmsc.cli.task_records`'s."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from dmsc.cli.app import console, err_console
from dmsc.cli.options import JsonOpt, message_from_flags
from dmsc.cli.progress import follow
from dmsc.cli.render import prediction_words
from dmsc.cli.runtime import control_client
from dmsc.runtime.transport.messages import (
    DEFAULT_LR,
    LR_SCHEDULES,
    MAX_INFER_TOKENS,
    InferRequest,
    TrainRequest,
)
from dmsc.runtime.transport.replies import InferEnd, InferPiece, TrainReply
from dmsc.spec import SpecError

_TRAIN_FLAGS = {
    "grad_wait_s": "--grad-wait",
    "warmup_steps": "--warmup",
    "min_lr_ratio": "--min-lr",
}


def train(
    steps: Annotated[int, typer.Option(help="Training steps.")] = 200,
    checkpoint_every: Annotated[
        int, typer.Option(help="Steps between checkpoints (0: only one before the first step).")
    ] = 50,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW).")] = DEFAULT_LR,
    lr_schedule: Annotated[
        str,
        typer.Option(
            help=f"Learning-rate schedule after the warm-up: {', '.join(LR_SCHEDULES)} "
            "(decay to --min-lr x --lr at the last step)."
        ),
    ] = "constant",
    warmup: Annotated[
        int, typer.Option(help="Steps of linear warm-up from --lr/warmup to --lr.")
    ] = 0,
    min_lr: Annotated[
        float, typer.Option(help="Where cosine and linear decay end, as a fraction of --lr.")
    ] = 0.0,
    batch: Annotated[
        int | None, typer.Option(help="Global batch in sequences (default: the plan's).")
    ] = None,
    microbatches: Annotated[
        int | None,
        typer.Option(help="Micro-batches per step (default: the plan's; divides --batch / dp)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the order the data is drawn in.")] = 0,
    data: Annotated[
        Path | None,
        typer.Option(
            help="Train on this text file or directory of files (its last tenth held out for "
            "validation) instead of the Python standard library's sources; it must lie in one "
            "of the control plane's data roots (dmsc up --data-root)."
        ),
    ] = None,
    priority: Annotated[
        int, typer.Option(help="The task's place in the queue: higher runs first (-100..100).")
    ] = 0,
    lane: Annotated[
        str,
        typer.Option(
            help="The queue's lane: sync (short tasks, run between a long task's steps) or "
            "async (long ones)."
        ),
    ] = "sync",
    late_policy: Annotated[
        str,
        typer.Option(help="Late data-parallel gradients: wait, skip (re-weight) or restart."),
    ] = "wait",
    grad_wait: Annotated[
        float, typer.Option(help="Seconds to wait for a replica's gradient (skip, restart).")
    ] = 5.0,
    sync: Annotated[
        str | None,
        typer.Option(
            help="How data-parallel replicas agree: every-step, diloco, fedavg or fedprox "
            "(MODE:STEPS sets the round length; default: the plan's, else every-step)."
        ),
    ] = None,
    inner_steps: Annotated[
        int | None, typer.Option(help="Local optimizer steps per round (default 50).")
    ] = None,
    local_steps: Annotated[
        int | None, typer.Option(help="The same, by its federated name.")
    ] = None,
    rounds: Annotated[
        int | None, typer.Option(help="Train this many rounds (steps = rounds x round length).")
    ] = None,
    outer_lr: Annotated[float, typer.Option(help="DiLoCo's outer learning rate.")] = 0.7,
    outer_momentum: Annotated[
        float, typer.Option(help="DiLoCo's outer Nesterov momentum (0: plain SGD).")
    ] = 0.9,
    prox_mu: Annotated[float, typer.Option(help="FedProx's proximal weight mu.")] = 0.01,
    inner_optimizer: Annotated[
        str, typer.Option(help="The replicas' own optimizer: adamw or sgd.")
    ] = "adamw",
    compress: Annotated[
        str,
        typer.Option(help="What replicas send: none, bf16, int8, topk:FRACTION or powersgd:RANK."),
    ] = "none",
    aggregator: Annotated[
        str,
        typer.Option(
            help="How the leader combines them: mean, median, trimmed-mean[:F], krum[:f] or "
            "multi-krum[:f]."
        ),
    ] = "mean",
    privacy_clip: Annotated[
        float | None, typer.Option(help="Differential privacy: clip each update to this norm.")
    ] = None,
    privacy_noise: Annotated[
        float, typer.Option(help="Noise multiplier (std = it x --privacy-clip on the sum).")
    ] = 0.0,
    privacy_delta: Annotated[float, typer.Option(help="The delta epsilon is reported at.")] = 1e-5,
    secure_aggregation: Annotated[
        bool, typer.Option(help="Mask updates so the leader learns only their sum.")
    ] = False,
    local_data: Annotated[
        bool,
        typer.Option(help="Each datacenter's replicas train on their own share of --data."),
    ] = False,
    skew: Annotated[
        float, typer.Option(help="How unevenly --local-data shares files out (0 random, 1 by run).")
    ] = 0.0,
    dp: Annotated[
        int | None,
        typer.Option(
            help="Train at this data-parallel degree: the deployment grows or shrinks to it from "
            "a checkpoint first (the planner re-places the replicas on the plan's cluster)."
        ),
    ] = None,
    task_heads: Annotated[
        bool,
        typer.Option(
            help="Each replica's last stage is its own task head (not averaged): combine them "
            "with dmsc infer --aggregate."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a training task on the running services; it survives failed workers. Progress shows
    while it runs (JSON lines with --json); Ctrl-C cancels it after its current step."""
    from dmsc.cli.train_sync import sync_settings, task_steps

    settings = sync_settings(
        sync,
        inner_steps,
        local_steps,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        prox_mu=prox_mu,
        inner_optimizer=inner_optimizer,
        compress=compress,
        aggregator=aggregator,
        privacy_clip=privacy_clip,
        privacy_noise=privacy_noise,
        privacy_delta=privacy_delta,
        secure=secure_aggregation,
        local_data=local_data,
        skew=skew,
        task_heads=task_heads,
    )
    steps = task_steps(steps, rounds, settings)

    if data is not None:  # the control plane reads it: a path it can resolve, checked here first
        if not data.exists():
            raise SpecError("command line", "--data", f"{data}: no such file or directory")
        data = data.resolve()
    req = message_from_flags(
        TrainRequest,
        _TRAIN_FLAGS,
        steps=steps,
        checkpoint_every=checkpoint_every,
        late_policy=late_policy,
        grad_wait_s=grad_wait,
        lr=lr,
        lr_schedule=lr_schedule,
        warmup_steps=warmup,
        min_lr_ratio=min_lr,
        batch=batch,
        microbatches=microbatches,
        seed=seed,
        data=str(data) if data is not None else None,
        sync=settings,
        dp=dp,
        priority=priority,
        lane=lane,
    )
    from dmsc.cli.privacy_effect import warn_about_noise

    warn_about_noise(settings, dp)  # before it runs: noise that outweighs the updates
    # The call answers when the task ends; meanwhile its steps show (Ctrl-C cancels it).
    out, interrupted = follow(control_client().train_future(req), steps, as_json)
    if as_json:
        print(json.dumps(out.wire()))
    elif out.state == "cancelled":
        console.print(
            f"task {out.task}: cancelled after {out.steps} steps "
            f"(model version {out.model_version})",
            highlight=False,
        )
    else:
        console.print(train_line(out), highlight=False)
        for line in segment_lines(out):
            console.print(line, highlight=False)
        for r in out.recoveries:
            console.print(
                f"recovered: replaced {', '.join(r.services) or 'nothing'} "
                f"({r.reason[:100]}) in {r.recovered_after_s:.1f} s, "
                f"back to the checkpoint of step {r.checkpoint_step}",
                highlight=False,
            )
    if interrupted:  # Ctrl-C cancelled the task: it did not run its course
        raise typer.Exit(130)


def train_line(out: TrainReply) -> str:
    """What ``dmsc train`` says about a task that ran its course."""
    step_s, val = out.median_step_s, f"validation {out.val_start:.3f} -> {out.val_end:.3f}"
    step = "step time unknown"
    if step_s is not None:
        words = prediction_words(step_s, out.predicted_step_s, out.prediction)
        step = f"step {step_s * 1e3:.1f} ms ({words}), {out.tokens_per_s:,.0f} tokens/s"
    loss = f"loss {out.loss_first:.3f} -> {out.loss_last:.3f}"
    return f"task {out.task}: {out.steps} steps, {loss}, {val}, {step}"


def segment_lines(out: TrainReply) -> list[str]:
    """What ``dmsc train`` says of each dp a task ran at, when a resize or a shrink changed it:
    the segment's median step against the prediction for that dp and plan (none when one)."""
    if len(out.segments) < 2:
        return []
    lines = []
    for seg in out.segments:
        step = "no step timed"
        if seg.median_step_s is not None:
            words = prediction_words(seg.median_step_s, seg.predicted_step_s, seg.prediction or "")
            step = f"step {seg.median_step_s * 1e3:.1f} ms ({words})"
        lines.append(f"  from step {seg.first_step} at dp {seg.dp}: {seg.steps} steps, {step}")
    return lines


def infer(
    prompt: Annotated[
        str | None, typer.Option(help="Text to continue (one request; or --batch).")
    ] = None,
    tokens: Annotated[
        int, typer.Option(help=f"Bytes to generate (at most {MAX_INFER_TOKENS}, as the gateway).")
    ] = 80,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature (0: always the most likely byte).")
    ] = 0.8,
    top_k: Annotated[
        int, typer.Option(help="Draw among the k most likely bytes only (0: all).")
    ] = 0,
    top_p: Annotated[
        float,
        typer.Option(help="Draw among the most likely bytes that hold this probability (1: all)."),
    ] = 1.0,
    seed: Annotated[
        int | None,
        typer.Option(help="Seed of the draws: the same seed gives the same text (default: new)."),
    ] = None,
    stream: Annotated[
        bool, typer.Option(help="Print the text as it is generated, byte by byte.")
    ] = True,
    aggregate: Annotated[
        str | None,
        typer.Option(
            help="Combine the task heads (dmsc train --task-heads) per byte: vote, weighted "
            "(by each head's held-out accuracy) or attention (a fitted combiner)."
        ),
    ] = None,
    batch: Annotated[
        Path | None,
        typer.Option(
            help="A JSON-lines file of requests (each line at least a prompt, with any field "
            "of POST /v1/infer) run as one queued task; prints each answer's text on a line "
            "of its own (escaped as in a JSON string), or JSON lines with --json."
        ),
    ] = None,
    priority: Annotated[
        int, typer.Option(help="--batch: the task's place in the queue (-100..100).")
    ] = 0,
    lane: Annotated[
        str, typer.Option(help="--batch: the queue's lane, sync (default) or async.")
    ] = "sync",
    as_json: JsonOpt = False,
) -> None:
    """Sample a continuation through the stage services. Ctrl-C stops the generation (the
    workers stop at their next token); with --batch, it cancels the batch's task."""
    if (prompt is None) == (batch is None):
        raise SpecError("command line", "--prompt", "give --prompt or --batch FILE (one)")
    if batch is not None:
        from dmsc.cli.infer_batch import run_batch

        run_batch(batch, priority, lane, as_json)
        return
    assert prompt is not None
    req = message_from_flags(
        InferRequest,
        {},
        prompt=prompt,
        tokens=tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        aggregate=aggregate,
    )
    # Streamed from the control plane in every mode: cancelling the call (Ctrl-C) stops the
    # workers at their next token.
    show = stream and not as_json
    calls = control_client().infer_stream(req)
    pieces: list[str] = []
    end: InferEnd | None = None
    if show:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    try:
        for piece in calls:
            if isinstance(piece, InferPiece):
                pieces.append(piece.text)
                if show:
                    sys.stdout.write(piece.text)
                    sys.stdout.flush()
            else:
                end = piece
    except KeyboardInterrupt:
        calls.cancel()
        if show:
            sys.stdout.write("\n")
        err_console.print(f"cancelled after {len(''.join(pieces))} characters")
        raise typer.Exit(130) from None
    text = "".join(pieces)
    said = {k: v for k, v in end.wire().items() if k != "done"} if end is not None else {}
    if as_json:
        print(json.dumps({"text": text, **said}))
    elif show:
        sys.stdout.write("\n")
    else:
        console.print(prompt + text, highlight=False, markup=False)
    if aggregate is not None and not as_json and end is not None:
        err_console.print(heads_line(end), highlight=False)


def heads_line(end: InferEnd) -> str:
    """What ``dmsc infer --aggregate`` says about the heads it combined."""
    answered = end.answered or []
    line = f"{end.aggregate} of {len(answered)}/{end.heads} heads"
    if end.weights:
        line += " weights " + " ".join(f"{w:.3f}" for w in end.weights)
    cal = end.calibration
    if cal:
        accs = " ".join("-" if a is None else f"{a:.3f}" for a in cal["accuracy"])
        line += f"; held-out accuracy ({cal['windows']} windows): heads {accs}"
        line += ", " + ", ".join(f"{m} {a:.3f}" for m, a in cal["combined"].items())
    for r, why in (end.missing or {}).items():
        line += f"; head {r} missing: {why}"
    return line
