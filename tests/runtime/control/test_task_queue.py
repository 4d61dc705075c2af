from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dmsc.data.db import Database
from dmsc.runtime.control.task_queue import TaskQueue


def _queue(url: str) -> TaskQueue:
    db = Database(url)
    run = db.new_run("gpt-mini", "local", {})
    return TaskQueue(db, run.id)


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
    q = _queue(url)
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
