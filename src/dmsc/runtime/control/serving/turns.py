"""Fair turns on a shared resource: the lock a replica's requests take once per token.

A plain lock lets whoever holds a replica keep it for a whole request (a 1,024-token request
held a replica for many seconds, and every other tenant's 4-token request waited behind it).
:class:`FairLock` is taken per token instead and, when several parties wait, grants it to them
in round robin: each waiting party (a tenant) gets one turn per round however many requests it
has in flight, so a tenant with many long requests slows the others by one token per round,
not by its whole backlog. Within a party, turns go first come, first served.

``acquire`` takes a deadline: a waiter whose deadline passes leaves the queue (False), so a
request past its deadline never holds or waits for the replica.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager


class FairLock:
    """A mutex granted in round robin over the parties waiting for it."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._granted: object | None = None  # the ticket the lock was handed to
        self._waiting: OrderedDict[str, deque[object]] = OrderedDict()

    def acquire(self, party: str = "", deadline: float | None = None) -> bool:
        """Take the lock for ``party``; False if ``deadline`` (``time.monotonic()``) passed
        first."""
        with self._cond:
            if not self._held:
                self._held = True
                return True
            ticket = object()
            self._waiting.setdefault(party, deque()).append(ticket)
            while self._granted is not ticket:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._withdraw(party, ticket)
                    return False
                self._cond.wait(left)
            self._granted = None
            return True

    def _withdraw(self, party: str, ticket: object) -> None:
        queue = self._waiting[party]
        queue.remove(ticket)
        if not queue:
            del self._waiting[party]

    def release(self) -> None:
        """Hand the lock to the next party in the round, or free it when none waits."""
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an unheld FairLock")
            if not self._waiting:
                self._held = False
                return
            party, queue = self._waiting.popitem(last=False)
            self._granted = queue.popleft()
            if queue:  # the party's next request waits at the back of the round
                self._waiting[party] = queue
            self._cond.notify_all()

    def waiting(self) -> dict[str, int]:
        """Waiters per party (for status and tests)."""
        with self._cond:
            return {p: len(q) for p, q in self._waiting.items()}

    @contextmanager
    def turn(self, party: str = "", deadline: float | None = None) -> Iterator[None]:
        """``with lock.turn(party, deadline):`` — raises :class:`TimeoutError` past the
        deadline."""
        if not self.acquire(party, deadline):
            raise TimeoutError("deadline passed while waiting for a turn")
        try:
            yield
        finally:
            self.release()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
