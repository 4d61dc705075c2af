"""The work a running deployment does for the user: ``dmsc train`` and ``dmsc infer``, each one
call to the control plane (which queues it as a task and survives failed workers)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from dmsc.cli.app import console
from dmsc.cli.options import JsonOpt
from dmsc.cli.runtime import control_client
from dmsc.spec import SpecError


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
    if steps <= 0:
        raise SpecError("command line", "--steps", "must be positive")
    if checkpoint_every < 0:
        raise SpecError("command line", "--checkpoint-every", "must be 0 or positive")
    if late_policy not in ("wait", "skip", "restart"):
        raise SpecError("command line", "--late-policy", "must be wait, skip or restart")
    if not grad_wait > 0:
        raise SpecError("command line", "--grad-wait", "must be positive")
    req = {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "late_policy": late_policy,
        "grad_wait_s": grad_wait,
    }
    out: dict[str, Any] = control_client().call("Train", req)
    if as_json:
        print(json.dumps(out))
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
    tokens: Annotated[int, typer.Option(help="Bytes to generate.")] = 80,
) -> None:
    """Sample a continuation through the stage services."""
    from dmsc.runtime.transport.messages import MAX_INFER_TOKENS

    if not 0 < tokens <= MAX_INFER_TOKENS:
        raise SpecError("command line", "--tokens", f"must be between 1 and {MAX_INFER_TOKENS}")
    out = control_client().call("Infer", {"prompt": prompt, "tokens": tokens})
    console.print(prompt + out["text"], highlight=False, markup=False)
