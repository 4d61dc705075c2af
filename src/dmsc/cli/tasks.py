"""The work a running deployment does for the user: ``dmsc train`` and ``dmsc infer``, each one
call to the control plane (which queues it as a task and survives failed workers), and
``dmsc tasks list|show|cancel``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from dmsc.cli.app import console
from dmsc.cli.options import JsonOpt, message_from_flags
from dmsc.cli.render import measured_vs_predicted
from dmsc.cli.runtime import control_client
from dmsc.runtime.transport.messages import MAX_INFER_TOKENS
from dmsc.spec import SpecError

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
    """Run a training task on the running services; it survives failed workers. Progress shows
    while it runs (JSON lines with --json); Ctrl-C cancels it after its current step."""
    from dmsc.runtime.transport.messages import TrainRequest

    req = message_from_flags(
        TrainRequest,
        _TRAIN_FLAGS,
        steps=steps,
        checkpoint_every=checkpoint_every,
        late_policy=late_policy,
        grad_wait_s=grad_wait,
    )
    from dmsc.cli.progress import follow

    # The call answers when the task ends; meanwhile its steps show (Ctrl-C cancels it).
    out = follow(control_client().send_future("Train", req), steps, as_json)
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
            f"{out['predicted_step_s'] * 1e3:.1f} ms: "
            f"{measured_vs_predicted(out['median_step_s'], out['predicted_step_s'])}), "
            f"{out['tokens_per_s']:,.0f} tokens/s",
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


tasks_app = typer.Typer(help="Tasks of the deployment: list, show, cancel.", no_args_is_help=True)


@tasks_app.command("list")
def tasks_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's tasks.")] = None,
    state: Annotated[
        str | None, typer.Option(help="Only tasks in this state (queued, running, done...).")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """The newest tasks, newest first."""
    from dmsc.cli.database import open_database
    from dmsc.cli.render import fit_table

    rows = open_database().recent_tasks(tenant, state, max(1, limit))
    if as_json:
        print(json.dumps([_task_row(t) for t in rows]))
        return
    t = fit_table(
        "id", "kind", "state", "tenant", "steps", "attempts", "created (UTC)", "error", keep=(0,)
    )
    for r in rows:
        steps = json.loads(r.params_json or "{}").get("steps", "")
        t.add_row(
            str(r.id),
            r.kind,
            r.state,
            r.tenant,
            str(steps),
            str(r.attempts),
            r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            (r.error or "")[:60],
        )
    console.print(t)


@tasks_app.command("show")
def tasks_show(
    task_id: Annotated[int, typer.Argument(help="Task id (`dmsc tasks list`).")],
    as_json: JsonOpt = False,
) -> None:
    """One task: its parameters, state, and the steps it has recorded."""
    from dmsc.cli.database import open_database
    from dmsc.data.db import TaskRecord

    db = open_database()
    with db.sessions() as s:
        task = s.get(TaskRecord, task_id)
    if task is None:
        raise SpecError("command line", "TASK_ID", f"no task {task_id}")
    out = _task_row(task)
    metrics = db.metrics(task_id)
    if metrics:
        out["steps_recorded"] = len(metrics)
        out["last_step"], out["last_loss"] = metrics[-1].step, metrics[-1].loss
    if as_json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        console.print(f"{k:15s} {v}", highlight=False, markup=False)


@tasks_app.command("cancel")
def tasks_cancel(task_id: Annotated[int, typer.Argument(help="Task id.")]) -> None:
    """Cancel a task: a queued one at once, a running one between two steps (it keeps what it
    trained and records a model version)."""
    from dmsc.cli.database import open_database
    from dmsc.data.db import TaskRecord
    from dmsc.runtime.business.queueing import TaskFinished
    from dmsc.runtime.control.task_queue import TaskQueue

    db = open_database()
    with db.sessions() as s:
        task = s.get(TaskRecord, task_id)
    if task is None:
        raise SpecError("command line", "TASK_ID", f"no task {task_id}")
    try:
        state = TaskQueue(db, task.run_id).cancel(task_id)
    except (KeyError, TaskFinished) as exc:
        raise SpecError("command line", "TASK_ID", str(exc).strip("'")) from None
    console.print(f"task {task_id}: {state}")


def _task_row(t: Any) -> dict[str, Any]:
    return {
        "id": t.id,
        "kind": t.kind,
        "state": t.state,
        "tenant": t.tenant,
        "params": json.loads(t.params_json or "{}"),
        "attempts": t.attempts,
        "created": t.created_at.isoformat(),
        "error": t.error,
    }
