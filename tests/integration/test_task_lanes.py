"""Each lane of the task queue has its own consumer: a short task does not wait behind a long
one on the other lane (issue 30, point 2). Real workers, the control plane in this process."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import control_plane, local_plan, wait_for

from dmsc.runtime.control.tasks import work_loop
from dmsc.runtime.control.tasks.task_queue import TaskQueue
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.transport.messages import TrainRequest


def _state(queue: TaskQueue, task_id: int) -> str:
    return next(t.state for t in queue.db.tasks() if t.id == task_id)


def test_a_short_task_behind_a_long_one_on_another_lane_finishes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    with control_plane(local_plan(), tmp_path) as cp:
        queue = TaskQueue(cp.db, cp.run.id)
        long = queue.submit("train", {"steps": 500, "checkpoint_every": 0}, lane="async")
        short = queue.submit("train", {"steps": 2, "checkpoint_every": 0}, lane="sync")
        threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
        wait_for(lambda: _state(queue, short.id) == "done", 120, "the short task")
        assert _state(queue, long.id) == "running"  # the long one started first and goes on
        wait_for(lambda: len(cp.db.metrics(long.id)) >= 4, 60, "the long task's next steps")
        assert queue.cancel(long.id) == "cancelling"
        wait_for(lambda: _state(queue, long.id) == "cancelled", 60, "the long task to stop")
        # The short task ran inside the long one: two steps of the same weights, numbered on
        # from where the long one paused; the long one went on from where the short one ended.
        before = [m.step for m in cp.db.metrics(long.id)]
        ran = [m.step for m in cp.db.metrics(short.id)]
        paused = ran[0]
        assert ran == [paused, paused + 1]
        assert [s for s in before if s < paused] == list(range(paused))
        after = [s for s in before if s >= paused]
        assert after == list(range(paused + 2, paused + 2 + len(after))) and after
        total = len(before) + 2
        assert cp.steps_done == total
        # each task saved the version it produced, the short one first (the replicas then
        # serve the production version, the first: the short one's)
        versions = [(v.task_id, v.step) for v in cp.db.versions(cp.run.id)]
        assert versions == [(short.id, paused + 2), (long.id, total)]


def test_the_train_call_does_not_wait_behind_a_long_queued_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dmsc train`` (the Train call, its task queued on the short lane, as the CLI asks by
    default) runs inside the long one, at the step that one paused at."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    with control_plane(local_plan(), tmp_path) as cp:
        queue = TaskQueue(cp.db, cp.run.id)
        long = queue.submit("train", {"steps": 500, "checkpoint_every": 0}, lane="async")
        threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
        wait_for(lambda: len(cp.db.metrics(long.id)) >= 2, 60, "the long task's first steps")
        out = cp.train(TrainRequest(steps=2, checkpoint_every=0, lane="sync"))  # dmsc train's
        assert out["state"] == "done" and out["steps"] == 2
        assert _state(queue, long.id) == "running"
        queue.cancel(long.id)
        wait_for(lambda: _state(queue, long.id) == "cancelled", 60, "the long task to stop")
        ran = [m.step for m in cp.db.metrics(out["task"])]
        assert len(ran) == 2 and ran[0] >= 2 and ran[1] == ran[0] + 1
        steps = [m.step for m in cp.db.metrics(long.id)]
        assert ran[0] in range(len(steps) + 1) and set(ran).isdisjoint(steps)
        assert cp.steps_done == len(steps) + 2


def test_a_crash_between_a_loan_and_the_long_tasks_checkpoint_after_it_resumes_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long task lends the weights at its third step; the short task trains two steps
    inside it; the control plane dies as the long task checkpoints where the short one left the
    weights. The restart resumes the long task from what the database says. The task's moved
    first step used to be stored before that checkpoint, so its newest checkpoint lay before
    its first step and the resume failed ("checkpoint of step 0 is outside 2..6")."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    with control_plane(local_plan(), tmp_path) as cp:
        long, params, lend, loans = _loan_at_step_2(cp, {"steps": 4, "checkpoint_every": 0})

        checkpoint = cp.deployment.checkpoint

        def dies_after_the_loan(step: int, *args: Any, **kwargs: Any) -> Any:
            if loans:
                raise RuntimeError("the control plane died here")
            return checkpoint(step, *args, **kwargs)

        monkeypatch.setattr(cp.deployment, "checkpoint", dies_after_the_loan)
        with pytest.raises(RuntimeError, match="died here"):
            cp.run_task(long.id, params(long.id), lend)
        assert loans == [4]  # the short task ran steps 2 and 3
        monkeypatch.setattr(cp.deployment, "checkpoint", checkpoint)
        report, _ = cp.run_task(long.id, params(long.id))  # the restart's resume
        # from its checkpoint before the loan (the loan's steps are the short task's version)
        assert (report.first_step, report.end_step) == (0, 4)
        assert [m.step for m in cp.db.metrics(long.id)] == [0, 1, 2, 3]


def test_the_checkpoints_from_before_a_loan_are_pruned_as_newer_ones_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long task checkpointing every step keeps its newest two (the retention rule) through a
    loan of its weights: those from before the loan, which a rollback no longer goes back to,
    used to leave the rule's count and stay on disk for good."""
    from dmsc.runtime.control.training.retention import Retention

    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    with control_plane(local_plan(), tmp_path) as cp:
        cp.retention = Retention(keep=2)
        long, params, lend, _ = _loan_at_step_2(cp, {"steps": 5, "checkpoint_every": 1})
        report, _ = cp.run_task(long.id, params(long.id), lend)
        assert (report.first_step, report.end_step) == (2, 7)  # moved by the short task's two
        kept = [c.step for c in cp.db.checkpoints(cp.run.id, long.id)]  # not pruned, newest first
        assert kept == [7, 6]
        left = sorted(p.name for p in (cp.run_dir / f"task{long.id}").iterdir())
        assert not {"step0", "step1", "step2"} & set(left), left  # from before the loan


def _loan_at_step_2(
    cp: Any, long_params: dict[str, Any]
) -> tuple[Any, Callable[[int], TrainParams], Callable[[], bool], list[int]]:
    """A long task of ``long_params`` on the long lane and a 2-step one on the short lane; the
    stored parameters of a task as the queue's consumer reads them; the lending the handoff
    does, which runs the short task inside the long one when it pauses at step 2 (once); and
    the step the weights were at after each loan."""
    queue = TaskQueue(cp.db, cp.run.id)
    long = queue.submit("train", long_params, lane="async")
    short = queue.submit("train", {"steps": 2, "checkpoint_every": 0}, lane="sync")

    def params(task_id: int) -> TrainParams:
        row = next(t for t in cp.db.tasks() if t.id == task_id)
        return work_loop._params(cp, json.loads(row.params_json))

    loans: list[int] = []

    def lend() -> bool:
        if cp.steps_done != 2 or loans:
            return False
        cp.run_task(short.id, params(short.id))
        loans.append(cp.steps_done)
        return True

    return long, params, lend, loans
