"""Fair turns on a shared resource: the lock a replica's requests take once per token.

A plain lock lets whoever holds a replica keep it for a whole request (a 1,024-token request
held a replica for many seconds, and every other tenant's 4-token request waited behind it).
:class:`FairLock` is taken per token instead and, when several parties wait, grants it to them
in round robin: each waiting party (a tenant) gets one turn per round however many requests it
has in flight, so a tenant with many long requests slows the others by one token per round,
not by its whole backlog. Within a party, turns go first come, first served.

A lock of ``width`` w grants up to w turns at once: a replica whose pipeline can hold tokens of
several requests at a time (one at each stage, and one being drawn at the control plane:
:attr:`~dmsc.runtime.control.launch.layout.StageLayout.tokens_in_flight`) lets that many in, so
its stages work on different requests side by side instead of waiting for each other. What
needs the replica whole (a training step, a heal) takes the lock whole (:meth:`acquire`, ``with
lock:``): it waits for the turns in flight to end, and the turns that come after it wait for it
(first come, first served across both kinds: neither starves the other).

``acquire`` takes a deadline: a waiter whose deadline passes leaves the queue (False), so a
request past its deadline never holds or waits for the replica.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(eq=False)
class _Ticket:
    whole: bool  # the lock whole, or one turn of its width


class FairLock:
    """Up to ``width`` turns at once, or the whole lock, granted in round robin over the
    parties waiting for it."""

    def __init__(self, width: int = 1) -> None:
        if width < 1:
            raise ValueError(f"a FairLock's width is at least 1, not {width}")
        self.width = width
        self._cond = threading.Condition(threading.Lock())
        self._turns = 0  # turns held
        self._whole = False  # held whole
        self._granted: set[_Ticket] = set()  # tickets handed the lock, not yet woken
        self._waiting: OrderedDict[str, deque[_Ticket]] = OrderedDict()

    def _fits(self, whole: bool) -> bool:
        if self._whole:
            return False
        return self._turns == 0 if whole else self._turns < self.width

    def _take(self, whole: bool) -> None:
        if whole:
            self._whole = True
        else:
            self._turns += 1

    def acquire(self, party: str = "", deadline: float | None = None, whole: bool = True) -> bool:
        """Take the lock (``whole``, or one turn) for ``party``; False if ``deadline``
        (``time.monotonic()``) passed first."""
        with self._cond:
            if not self._waiting and self._fits(whole):
                self._take(whole)
                return True
            ticket = _Ticket(whole)
            self._waiting.setdefault(party, deque()).append(ticket)
            while ticket not in self._granted:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._withdraw(party, ticket)
                    self._grant()  # it may have held up those behind it
                    return False
                self._cond.wait(left)
            self._granted.discard(ticket)
            return True

    def _withdraw(self, party: str, ticket: _Ticket) -> None:
        queue = self._waiting[party]
        queue.remove(ticket)
        if not queue:
            del self._waiting[party]

    def _grant(self) -> None:
        """Hand the lock to the waiters at the front of the round while it has room for them."""
        granted = False
        while self._waiting:
            party, queue = next(iter(self._waiting.items()))
            if not self._fits(queue[0].whole):
                break
            self._waiting.popitem(last=False)
            ticket = queue.popleft()
            if queue:  # the party's next request waits at the back of the round
                self._waiting[party] = queue
            self._take(ticket.whole)
            self._granted.add(ticket)
            granted = True
        if granted:
            self._cond.notify_all()

    def release(self) -> None:
        """Give back the whole lock or one turn, and hand what is free to the next in the
        round."""
        with self._cond:
            if self._whole:
                self._whole = False
            elif self._turns:
                self._turns -= 1
            else:
                raise RuntimeError("release of an unheld FairLock")
            self._grant()

    def waiting(self) -> dict[str, int]:
        """Waiters per party (for status and tests)."""
        with self._cond:
            return {p: len(q) for p, q in self._waiting.items()}

    def held(self) -> int:
        """Turns held now (the width when held whole)."""
        with self._cond:
            return self.width if self._whole else self._turns

    @contextmanager
    def turn(self, party: str = "", deadline: float | None = None) -> Iterator[None]:
        """``with lock.turn(party, deadline):`` one turn — raises :class:`TimeoutError` past
        the deadline."""
        if not self.acquire(party, deadline, whole=False):
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
