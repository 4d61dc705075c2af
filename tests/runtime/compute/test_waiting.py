"""Waiting for a collective awake, then asleep: against a work that completes when told, and a
real two-rank gloo all-reduce (the sum as a blocking one gives it)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dmsc.runtime.compute.waiting import SPIN_S, awake_until, finish


class _Work:
    """A work that completes after ``polls`` looks, or never (``None``)."""

    def __init__(self, polls: int | None, error: Exception | None = None) -> None:
        self.polls, self.looks, self.waited, self.error = polls, 0, False, error

    def is_completed(self) -> bool:
        self.looks += 1
        return self.polls is not None and self.looks > self.polls

    def wait(self) -> None:
        self.waited = True
        if self.error is not None:
            raise self.error


def test_a_work_done_soon_is_waited_for_awake_and_then_joined() -> None:
    # a budget no machine's load exhausts: with the default 4 ms, a loaded machine (the suite
    # beside a busy core) ended the spin before the sixth look, and the test failed
    work = _Work(polls=5)
    finish(work, spin_s=60.0)
    assert work.looks == 6 and work.waited


def test_a_long_work_is_waited_for_asleep_after_the_spin() -> None:
    work = _Work(polls=None)
    t0 = time.perf_counter()
    finish(work, spin_s=0.01)
    took = time.perf_counter() - t0
    assert work.waited and work.looks > 1
    assert 0.01 <= took < 0.5  # the spin's budget, then the blocking wait (here at once)


def test_a_device_work_is_not_spun_on_and_errors_come_through() -> None:
    work = _Work(polls=3)
    finish(work, cpu=False)
    assert work.looks == 0 and work.waited
    with pytest.raises(RuntimeError, match="peer gone"):
        finish(_Work(polls=0, error=RuntimeError("peer gone")))


def test_awake_until_says_whether_it_came_true_within_the_budget() -> None:
    assert awake_until(lambda: True)
    t0 = time.perf_counter()
    assert not awake_until(lambda: False, 0.005)
    assert time.perf_counter() - t0 >= 0.005
    assert SPIN_S > 0


def test_a_real_all_reduce_waited_for_awake_sums_as_a_blocking_one() -> None:
    """Two gloo ranks in two threads of this process, each its own group over one store."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    results: dict[int, tuple[bool, float]] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False)
        pg = dist.ProcessGroupGloo(client, r, 2, timedelta(seconds=30))
        x = torch.arange(1000, dtype=torch.float32) * (r + 1)
        y = x.clone()
        finish(pg.allreduce([x]))
        pg.allreduce([y]).wait()
        results[r] = (torch.equal(x, y), float(x[7]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: (True, 21.0), 1: (True, 21.0)}
