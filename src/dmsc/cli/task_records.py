"""``dmsc tasks list|show|cancel``: the deployment's tasks as its database records them (a task
of ``dmsc train``, ``dmsc infer --batch`` or the gateway's ``POST /v1/tasks``)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.text import Text

from dmsc.cli.app import console
from dmsc.cli.options import JsonOpt
from dmsc.cli.tables import FoldTable
from dmsc.spec import SpecError

tasks_app = typer.Typer(help="Tasks of the deployment: list, show, cancel.", no_args_is_help=True)


@tasks_app.command("list")
def tasks_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's tasks.")] = None,
    state: Annotated[
        str | None,
        typer.Option(
            help="Only tasks in this state: queued, running, cancelling, done, failed, cancelled."
        ),
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """The newest tasks, newest first."""
    from dmsc.cli.database import open_database
    from dmsc.cli.render import fit_table
    from dmsc.data.db import TASK_STATES

    if state is not None and state not in TASK_STATES:
        raise SpecError("command line", "--state", f"{state!r} is none of {', '.join(TASK_STATES)}")
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
    from dmsc.data.traces import worker_usage

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
    # what each worker's process used over the steps (dmsc.runtime.compute.telemetry)
    usage = {k: u for k, u in worker_usage(db, task_id).items() if u["steps"]}
    if usage:
        out["workers"] = usage
    if as_json:
        print(json.dumps(out))
        return
    out["attempts"] = f"{task.attempts} of {task.max_attempts}"
    for key, u in out.pop("workers", {}).items():
        out[f"worker {key}"] = _usage_words(u)
    t = FoldTable(show_header=False, box=None, padding=(0, 1, 0, 0))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for k, v in out.items():
        t.add_row(k, Text(_words(v)))
    console.print(t)


def _usage_words(u: dict[str, Any]) -> str:
    """A worker's use over a task's steps in words (``tasks show``)."""
    from dmsc.cli.render import human_bytes

    words = f"{u['steps']} steps measured, CPU {u['cpu_percent_mean']:.0f}% of a core on average"
    words += f" ({u['cpu_percent_max']:.0f}% at most)"
    if u["rss_bytes_max"] is not None:
        words += f", memory {human_bytes(u['rss_bytes_max'])} at most"
    if u["gpu_peak_bytes_max"] is not None:
        words += f", GPU memory {human_bytes(u['gpu_peak_bytes_max'])} at the peak"
    return words


def _words(value: Any) -> str:
    """A field of ``tasks show`` as words: a mapping as ``key=value, ...``, nothing as ``-``."""
    if value is None or value == "":
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_words(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return "[" + ", ".join(_words(v) for v in value) + "]"
    return str(value)


@tasks_app.command("cancel")
def tasks_cancel(task_id: Annotated[int, typer.Argument(help="Task id.")]) -> None:
    """Cancel a task: a queued one at once, a running one between two steps (it keeps what it
    trained and records a model version)."""
    from dmsc.cli.database import open_database
    from dmsc.data.db import TaskRecord
    from dmsc.runtime.business.queueing import TaskFinished
    from dmsc.runtime.control.tasks.task_queue import TaskQueue

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
        "result": json.loads(t.result_json) if t.result_json else None,
    }
