"""The task queue across a stop and a cancel, on a control plane with real workers: tasks queued
before a stop run after the next start, and a running task cancelled stops between two steps,
keeping what it did. (Issue 10: "queue gaps".)"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from runtime_helpers import control_plane, local_plan, wait_for

from dmsc.planner.plan import Plan
from dmsc.runtime.control.tasks.task_queue import TaskQueue


@pytest.fixture(scope="module")
def plan() -> Plan:
    return local_plan()


def _state(queue: TaskQueue, task_id: int) -> str:
    return next(t.state for t in queue.db.tasks() if t.id == task_id)


def test_tasks_queued_before_a_stop_run_after_the_next_start(
    plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    with control_plane(plan, tmp_path) as cp:
        queue = TaskQueue(cp.db, cp.run.id)
        ids = [queue.submit("train", {"steps": 2, "checkpoint_every": 0}).id for _ in range(2)]
        cp.end_run()  # `dmsc down` before the queue got to them
        stopped = cp.run.id
    with control_plane(plan, tmp_path) as cp:  # `dmsc up`: a new run
        assert cp.run.id != stopped
        queue = TaskQueue(cp.db, cp.run.id)
        threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
        wait_for(lambda: all(_state(queue, i) == "done" for i in ids), 120, "the tasks of the stop")
        assert {t.run_id for t in cp.db.tasks() if t.id in ids} == {cp.run.id}
        assert [m.step for i in ids for m in cp.db.metrics(i)] == [0, 1, 2, 3]
        # each task records the model version it produced
        versions = [(v.task_id, v.step) for v in cp.db.versions(cp.run.id)]
        assert versions == [(ids[0], 2), (ids[1], 4)]


def test_a_running_task_cancels_between_steps_and_keeps_what_it_did(
    plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    with control_plane(plan, tmp_path) as cp:
        queue = TaskQueue(cp.db, cp.run.id)
        threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
        task = queue.submit("train", {"steps": 5000, "checkpoint_every": 50})
        wait_for(lambda: len(cp.db.metrics(task.id)) >= 3, 120, "three steps")
        assert queue.cancel(task.id) == "cancelling"
        wait_for(lambda: _state(queue, task.id) == "cancelled", 60, "the task to stop")
        done = len(cp.db.metrics(task.id))
        assert 3 <= done < 5000
        # What it did is kept: the weights, a checkpoint and a model version where it stopped.
        assert cp.steps_done == done
        assert [int(h["steps"]) for h in cp.deployment.health()] == [done, done]
        assert cp.checkpoints(task.id)[0].step == done
        assert [(v.task_id, v.step) for v in cp.db.versions(cp.run.id)] == [(task.id, done)]
        with pytest.raises(ValueError, match="cancelled"):
            queue.cancel(task.id)
        # the next task goes on from there
        after = queue.submit("train", {"steps": 1, "checkpoint_every": 0})
        wait_for(lambda: _state(queue, after.id) == "done", 60, "the next task")
        assert [m.step for m in cp.db.metrics(after.id)] == [done]
