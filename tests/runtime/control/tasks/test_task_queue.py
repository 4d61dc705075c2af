from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from dmsc.data.db import Database
from dmsc.runtime.control.tasks.task_queue import (
    QuotaExceeded,
    TaskFinished,
    TaskQueue,
    cancel_requested,
)


def _queue(url: str, **quotas: int) -> TaskQueue:
    db = Database(url)
    run = db.new_run("gpt-mini", "local", {})
    return TaskQueue(db, run.id, **quotas)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'q.sqlite'}"
    pg = os.environ.get("DMSC_TEST_POSTGRES_URL")
    assert pg, "DMSC_TEST_POSTGRES_URL is not set: run the tests with `make test`"
    return pg


def test_fcfs_and_priority_with_urgent_insertion(url: str) -> None:
    q = _queue(url)
    a = q.submit("train", {"n": 1})
    b = q.submit("train", {"n": 2}, priority=1)
    c = q.submit("train", {"n": 3})
    urgent = q.submit("infer", {}, priority=10)  # inserted last, served first
    order = [q.claim("priority").id for _ in range(4)]  # type: ignore[union-attr]
    assert order == [urgent.id, b.id, a.id, c.id]
    assert q.claim("priority") is None
    q2 = _queue(url)
    ids = [q2.submit("train", {}, priority=p).id for p in (0, 5, 1)]
    assert [q2.claim("fcfs").id for _ in range(3)] == ids  # type: ignore[union-attr]


def test_weighted_fair_share(url: str) -> None:
    q = _queue(url)
    for _ in range(6):
        q.submit("train", {}, tenant="alice", weight=2.0)
        q.submit("train", {}, tenant="bob", weight=1.0)
    served = [q.claim("fair").tenant for _ in range(9)]  # type: ignore[union-attr]
    # Alice has twice Bob's weight: 6 of the first 9 go to her.
    assert served.count("alice") == 6 and served.count("bob") == 3


def test_lanes_retries_exception_queue_and_requeue(url: str) -> None:
    q = _queue(url)
    long = q.submit("train", {}, lane="async", max_attempts=2)
    short = q.submit("infer", {})
    assert q.claim(lane="sync").id == short.id  # type: ignore[union-attr]
    task = q.claim(lane="async")
    assert task is not None and task.id == long.id
    assert q.fail(task.id, TimeoutError("stage 1 did not answer")) == "queued"  # retry
    again = q.claim(lane="async")
    assert again is not None and again.attempts == 2
    assert q.fail(again.id, RuntimeError("boom"), log="x" * 5000) == "failed"
    [parked] = q.exceptions()
    assert parked.exception_type == "RuntimeError" and len(parked.log_excerpt or "") == 2000
    q.requeue(parked.id)
    assert q.depth("async") == 1 and q.exceptions() == []
    with pytest.raises(KeyError):
        q.requeue(short.id)


def test_a_restart_loses_no_queued_task(url: str) -> None:
    q = _queue(url)
    ids = [q.submit("train", {"i": i}).id for i in range(5)]
    q.claim()
    restarted = TaskQueue(Database(url), q.run_id)  # a new process, same database
    assert restarted.depth() == 4
    assert sorted(t.id for t in [restarted.claim("fcfs") for _ in range(4)] if t) == ids[1:]


def test_concurrent_claims_never_share_a_task(url: str) -> None:
    q = _queue(url, max_queued_tasks=30)
    for _ in range(30):
        q.submit("infer", {})
    got: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        mine = TaskQueue(Database(url), q.run_id)
        while (task := mine.claim("fcfs")) is not None:
            with lock:
                got.append(task.id)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 30 and len(set(got)) == 30


def test_quotas_per_tenant_on_queued_tasks_and_steps(url: str) -> None:
    """Issue 10: a fuzzing tenant queued 101 tasks, 11.2 million steps, in 29 s."""
    q = _queue(url, max_queued_tasks=3, max_queued_steps=1000)
    for _ in range(3):
        q.submit("train", {"steps": 100}, tenant="fuzz")
    with pytest.raises(QuotaExceeded, match="queued tasks per tenant"):
        q.submit("train", {"steps": 1}, tenant="fuzz")
    q.submit("train", {"steps": 900}, tenant="other")  # another tenant's quota is its own
    with pytest.raises(QuotaExceeded, match="queued steps per tenant"):
        q.submit("train", {"steps": 101}, tenant="other")
    assert q.depth() == 4
    q.claim("fcfs")  # a task that runs no longer counts as queued
    q.submit("train", {"steps": 100}, tenant="fuzz")
    with pytest.raises(ValueError, match="steps"):
        q.submit("train", {"steps": "many"}, tenant="x")
    default = _queue(url)
    assert (default.max_queued_tasks, default.max_queued_steps) == (16, 100_000)
    with pytest.raises(QuotaExceeded, match="queued steps per tenant"):
        default.submit("train", {"steps": 100_001})
    assert issubclass(QuotaExceeded, ValueError)


def test_cancel_queued_at_once_running_on_request(url: str) -> None:
    q = _queue(url)
    waiting = q.submit("train", {"steps": 5})
    running = q.submit("train", {"steps": 5})
    assert q.cancel(waiting.id) == "cancelled"
    assert q.claim("fcfs").id == running.id  # type: ignore[union-attr]  # never the cancelled
    assert not cancel_requested(q.db, running.id)
    assert q.cancel(running.id) == "cancelling"
    assert q.cancel(running.id) == "cancelling"  # asking again changes nothing
    assert cancel_requested(q.db, running.id)
    q.complete(running.id, cancelled=True)
    states = {t.id: t for t in q.db.tasks(q.run_id)}
    assert states[running.id].state == "cancelled" and states[running.id].finished_at
    assert states[waiting.id].state == "cancelled" and states[waiting.id].finished_at
    with pytest.raises(TaskFinished, match="cancelled"):
        q.cancel(running.id)
    with pytest.raises(KeyError):
        q.cancel(10_000_000)
    # a running task that fails while asked to cancel ends cancelled, not retried
    other = q.submit("train", {"steps": 5})
    q.claim("fcfs")
    q.cancel(other.id)
    assert q.fail(other.id, RuntimeError("stage 1 died")) == "cancelled"


def test_orphans_of_a_stopped_run_move_into_the_next_or_fail(url: str) -> None:
    """Issue 10: tasks queued before `dmsc down` stayed `queued` forever after `dmsc up`."""
    db = Database(url)
    old = db.new_run("gpt-mini", "local", {})
    q_old = TaskQueue(db, old.id)
    queued = q_old.submit("train", {"steps": 5}, tenant="t", priority=2)
    cut = q_old.submit("train", {"steps": 5})
    q_old.claim("fcfs")  # cut short by the stop, with its progress in the old run
    db.set_task_params(cut.id, {"steps": 5, "first_step": 40})
    infer = db.new_task(old.id, "infer", {"tokens": 3}, state="running")
    other_model = db.new_run("gpt-small", "local", {})
    foreign = TaskQueue(db, other_model.id).submit("train", {"steps": 5})
    db.end_run(old.id)
    db.end_run(other_model.id)
    live = db.new_run("gpt-mini", "elsewhere", {})  # running: another control plane's, untouched
    theirs = TaskQueue(db, live.id).submit("train", {"steps": 5})
    new = db.new_run("gpt-mini", "local", {})
    q = TaskQueue(db, new.id)
    out = q.adopt_orphans("gpt-mini")
    assert out["requeued"] == [queued.id, cut.id]
    assert sorted(out["failed"]) == sorted([infer.id, foreign.id])
    tasks = {t.id: t for t in db.tasks()}
    assert tasks[queued.id].run_id == new.id and tasks[queued.id].state == "queued"
    assert tasks[queued.id].priority == 2 and tasks[queued.id].tenant == "t"
    assert json.loads(tasks[cut.id].params_json) == {"steps": 5}  # starts afresh in this run
    assert tasks[foreign.id].state == "failed" and "gpt-small" in (tasks[foreign.id].error or "")
    assert tasks[infer.id].state == "failed" and tasks[infer.id].finished_at
    assert tasks[theirs.id].run_id == live.id and tasks[theirs.id].state == "queued"
    assert [q.claim("fcfs").id for _ in range(2)] == [queued.id, cut.id]  # type: ignore[union-attr]
    assert q.adopt_orphans("gpt-mini") == {"requeued": [], "failed": [], "cancelled": []}
