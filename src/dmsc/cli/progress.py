"""Progress bars: :func:`elapsed_bar` for the simulations, and what ``dmsc train`` shows while
its task runs: a progress bar (step, loss, step time, tokens/s, ETA) in a terminal, or one JSON
line per step with ``--json``; Ctrl-C cancels the task.

The Train call to the control plane answers once the task ends; meanwhile its steps are read
from the database the control plane records them in (the task is the newest ``train`` task that
started after the call), so no second channel is needed.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dmsc.cli.app import err_console

if TYPE_CHECKING:
    from dmsc.runtime.control.client import PendingTrain
    from dmsc.runtime.transport.replies import TrainReply

POLL_S = 0.5


def elapsed_bar(disable: bool, console: Console | None = None) -> Progress:
    """A bar with its task's description and the time so far, on ``console`` (standard error by
    default; it leaves nothing behind; off with ``--json``, whose output is the JSON alone)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console or err_console,
        transient=True,
        disable=disable,
    )


def find_task(db: Any, since: float) -> int | None:
    """The training task a Train call sent at ``since`` runs as (None until it starts)."""
    from sqlalchemy import select

    from dmsc.data.db import TaskRecord

    with db.sessions() as s:
        for task in s.scalars(
            select(TaskRecord)
            .where(TaskRecord.kind == "train", TaskRecord.state.in_(("running", "cancelling")))
            .order_by(TaskRecord.id.desc())
        ):
            if task.created_at.timestamp() >= since - 1.0:
                return int(task.id)
    return None


def follow(future: PendingTrain, steps: int, as_json: bool) -> tuple[TrainReply, bool]:
    """Wait for the Train call ``future`` while showing its task's steps, and return its answer
    and whether Ctrl-C cancelled it. Ctrl-C asks the task to stop (it ends ``cancelled`` after
    its current step, keeping what it trained); a second one stops waiting; one before the
    task shows cancels the call, and the control plane cancels the task with it: exit 130,
    with what became of the task."""
    from dmsc.cli.database import open_database

    db = open_database()
    since = time.time()
    task_id: int | None = None
    seen = 0
    cancelled = False
    progress = Progress(
        TextColumn("[bold]task {task.fields[task]}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}  {task.fields[step_ms]} ms/step  {task.fields[tps]}"),
        TimeRemainingColumn(),
        console=err_console,
        disable=as_json,
        transient=True,
    )
    bar = progress.add_task("train", total=steps, task="?", loss="-", step_ms="-", tps="")
    with progress:
        while True:
            try:
                if future.done():
                    break
                time.sleep(POLL_S)
                if task_id is None:
                    task_id = find_task(db, since)
                    if task_id is None:
                        continue
                    progress.update(bar, task=str(task_id))
                metrics = db.metrics(task_id)
                seen = _lines(task_id, metrics, seen, as_json)
                if metrics:
                    last = metrics[-1]
                    progress.update(
                        bar,
                        completed=len(metrics),
                        loss=f"{last.loss:.3f}",
                        step_ms=f"{last.step_s * 1e3:.0f}",
                        tps=f"{last.tokens_per_s:,.0f} tokens/s",
                    )
            except KeyboardInterrupt:
                if cancelled or task_id is None:
                    progress.stop()
                    if not cancelled:  # the call going away cancels its task (.tasks.door)
                        future.cancel()
                    err_console.print(
                        f"stopped waiting: task {task_id} still ends after its current step"
                        if cancelled
                        else "stopped waiting: the Train call is cancelled and the control "
                        "plane cancels the task with it (a queued one at once, one that "
                        "started after its current step; dmsc tasks list shows it)",
                        highlight=False,
                    )
                    raise typer.Exit(130) from None
                cancelled = True
                from dmsc.runtime.control.tasks.task_queue import TaskQueue

                with db.sessions() as s:
                    from dmsc.data.db import TaskRecord

                    run_id = s.get(TaskRecord, task_id).run_id  # type: ignore[union-attr]
                TaskQueue(db, run_id).cancel(task_id)
                err_console.print(
                    f"cancelling task {task_id}: it stops after its current step "
                    "(Ctrl-C again to stop waiting; the task still ends)",
                    highlight=False,
                )
    out = future.result()
    _lines(out.task, db.metrics(out.task), seen, as_json)  # the last steps
    return out, cancelled


def _lines(task_id: int, metrics: list[Any], seen: int, as_json: bool) -> int:
    """Print the steps after the first ``seen`` as JSON lines (with ``--json``); returns how
    many are printed in all."""
    if as_json:
        for m in metrics[seen:]:
            line = {"task": task_id, "step": m.step, "loss": m.loss}
            line |= {"step_s": m.step_s, "tokens_per_s": m.tokens_per_s}
            print(json.dumps(line), flush=True)
    return max(seen, len(metrics))
