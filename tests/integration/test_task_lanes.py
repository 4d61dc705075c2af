"""Each lane of the task queue has its own consumer: a short task does not wait behind a long
one on the other lane (issue 30, point 2). Real workers, the control plane in this process."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from runtime_helpers import control_plane, local_plan, wait_for

from dmsc.runtime.control.tasks.task_queue import TaskQueue
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
