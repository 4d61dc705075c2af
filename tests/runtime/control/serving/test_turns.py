"""FairLock: requests on a replica take turns per token, tenants in round robin."""

from __future__ import annotations

import threading
import time

import pytest

from dmsc.runtime.control.serving.turns import FairLock


def _queue_up(lock: FairLock, arrivals: list[str], log: list[str]) -> list[threading.Thread]:
    """A thread per arrival, each queued (in this order) behind the held lock; each logs its
    party when it gets the lock."""
    threads = []
    for n, party in enumerate(arrivals):

        def take(party: str = party) -> None:
            with lock.turn(party):
                log.append(party)

        t = threading.Thread(target=take)
        t.start()
        while sum(lock.waiting().values()) < n + 1:  # queued in arrival order
            time.sleep(0.001)
        threads.append(t)
    return threads


def _round_robin(arrivals: list[str]) -> list[str]:
    """The reference: parties in order of first arrival, one turn each per round."""
    order = list(dict.fromkeys(arrivals))
    left = {p: arrivals.count(p) for p in order}
    out = []
    while any(left.values()):
        for p in order:
            if left[p]:
                out.append(p)
                left[p] -= 1
    return out


@pytest.mark.parametrize(
    "arrivals",
    [
        ["a", "a", "a", "a", "b"],  # a tenant's backlog does not hold another's single turn
        ["a", "b", "a", "c", "a", "b"],
        ["x"] * 3,
    ],
)
def test_waiters_are_served_in_round_robin_over_parties(arrivals: list[str]) -> None:
    lock = FairLock()
    log: list[str] = []
    lock.acquire("holder")
    threads = _queue_up(lock, arrivals, log)
    lock.release()
    for t in threads:
        t.join(5)
    assert log == _round_robin(arrivals)


def test_a_waiter_past_its_deadline_leaves_the_queue() -> None:
    lock = FairLock()
    lock.acquire()
    t0 = time.monotonic()
    assert not lock.acquire("late", deadline=time.monotonic() + 0.1)
    assert 0.09 <= time.monotonic() - t0 < 1.0
    assert lock.waiting() == {}
    with pytest.raises(TimeoutError), lock.turn("late", deadline=time.monotonic() + 0.05):
        pass
    lock.release()
    assert lock.acquire("next", deadline=time.monotonic() + 0.1)  # free again
    lock.release()


def test_release_of_an_unheld_lock_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        FairLock().release()
