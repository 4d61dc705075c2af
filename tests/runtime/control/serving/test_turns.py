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


def _in_thread(fn: object) -> threading.Thread:
    t = threading.Thread(target=fn)  # type: ignore[arg-type]
    t.start()
    return t


def _until(cond: object, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_a_lock_of_width_two_lets_two_turns_in_at_once_and_queues_the_third() -> None:
    """A replica of two stages holds a token of each of two requests (and one being drawn):
    their turns overlap, up to the width."""
    lock = FairLock(width=2)
    assert lock.acquire("a", whole=False) and lock.acquire("b", whole=False)
    assert lock.held() == 2
    got: list[str] = []
    third = _in_thread(lambda: lock.acquire("c", whole=False) and got.append("c"))
    _until(lambda: lock.waiting() == {"c": 1})
    assert got == []
    lock.release()
    third.join(5)
    assert got == ["c"] and lock.held() == 2
    lock.release()
    lock.release()
    assert lock.held() == 0


def test_the_whole_lock_waits_for_the_turns_in_flight_and_later_turns_wait_for_it() -> None:
    """A training step takes the replica whole: it waits for the tokens in flight, and a token
    asked for after it waits for the step (first come, first served: neither starves)."""
    lock = FairLock(width=3)
    lock.acquire("a", whole=False)
    lock.acquire("b", whole=False)
    log: list[str] = []

    def train() -> None:
        with lock:
            log.append("train")
            time.sleep(0.05)
            log.append("trained")

    def token() -> None:
        with lock.turn("c"):
            log.append("c")

    trainer = _in_thread(train)
    _until(lambda: lock.waiting() == {"": 1})
    later = _in_thread(token)  # room for it (width 3), but it came after the whole lock
    _until(lambda: sum(lock.waiting().values()) == 2)
    lock.release()
    time.sleep(0.02)
    assert log == []  # one turn still in flight
    lock.release()
    trainer.join(5)
    later.join(5)
    assert log == ["train", "trained", "c"]
    assert lock.held() == 0


def test_a_whole_waiter_past_its_deadline_lets_the_turns_behind_it_in() -> None:
    lock = FairLock(width=2)
    lock.acquire("a", whole=False)
    got: list[str] = []
    whole = _in_thread(lambda: got.append(str(lock.acquire("t", time.monotonic() + 0.1))))
    _until(lambda: lock.waiting() == {"t": 1})
    behind = _in_thread(lambda: lock.acquire("b", whole=False) and got.append("b"))
    whole.join(5)
    behind.join(5)
    assert sorted(got) == ["False", "b"]  # the one timed out, the one behind it let in
    assert lock.held() == 2


def test_a_width_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairLock(width=0)
