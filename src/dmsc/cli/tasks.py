"""The work a running deployment does for the user: ``dmsc train`` and ``dmsc infer``, each one
call to the control plane (which queues it as a task and survives failed workers)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from dmsc.cli.app import console
from dmsc.cli.options import JsonOpt, message_from_flags
from dmsc.cli.runtime import control_client
from dmsc.runtime.transport.messages import MAX_INFER_TOKENS

_TRAIN_FLAGS = {"grad_wait_s": "--grad-wait"}


def train(
    steps: Annotated[int, typer.Option(help="Training steps.")] = 200,
    checkpoint_every: Annotated[
        int, typer.Option(help="Steps between checkpoints (0: only one before the first step).")
    ] = 50,
    late_policy: Annotated[
        str,
        typer.Option(help="Late data-parallel gradients: wait, skip (re-weight) or restart."),
    ] = "wait",
    grad_wait: Annotated[
        float, typer.Option(help="Seconds to wait for a replica's gradient (skip, restart).")
    ] = 5.0,
    as_json: JsonOpt = False,
) -> None:
    """Run a training task on the running services; it survives failed workers."""
    from dmsc.runtime.transport.messages import TrainRequest

    req = message_from_flags(
        TrainRequest,
        _TRAIN_FLAGS,
        steps=steps,
        checkpoint_every=checkpoint_every,
        late_policy=late_policy,
        grad_wait_s=grad_wait,
    )
    out: dict[str, Any] = control_client().send("Train", req)
    if as_json:
        print(json.dumps(out))
    elif out.get("state") == "cancelled":
        console.print(
            f"task {out['task']}: cancelled after {out['steps']} steps "
            f"(model version {out['model_version']})",
            highlight=False,
        )
    else:
        console.print(
            f"task {out['task']}: {out['steps']} steps, loss {out['loss_first']:.3f} -> "
            f"{out['loss_last']:.3f}, validation {out['val_start']:.3f} -> {out['val_end']:.3f}, "
            f"step {out['median_step_s'] * 1e3:.1f} ms (predicted "
            f"{out['predicted_step_s'] * 1e3:.1f} ms), {out['tokens_per_s']:,.0f} tokens/s",
            highlight=False,
        )
        for r in out.get("recoveries", []):
            console.print(
                f"recovered: replaced {', '.join(r['services']) or 'nothing'} "
                f"({r['reason'][:100]}) in {r['recovered_after_s']:.1f} s, "
                f"back to the checkpoint of step {r['checkpoint_step']}",
                highlight=False,
            )


def infer(
    prompt: Annotated[str, typer.Option(help="Text to continue.")],
    tokens: Annotated[
        int, typer.Option(help=f"Bytes to generate (at most {MAX_INFER_TOKENS}, as the gateway).")
    ] = 80,
) -> None:
    """Sample a continuation through the stage services."""
    from dmsc.runtime.transport.messages import InferRequest

    req = message_from_flags(InferRequest, {}, prompt=prompt, tokens=tokens)
    out = control_client().send("Infer", req)
    console.print(prompt + out["text"], highlight=False, markup=False)
