"""The weights between the lanes' consumers: a short task does not wait behind a long one.

Each lane of the task queue has its own consumer thread (:mod:`.work_loop`), but the replicas'
weights are one: a task trains them under the control plane's lock. A consumer takes the lock
through :meth:`Handoff.hold`. The long lane's (``async``) session, between two steps, asks
:meth:`Handoff.lend`: when a task of the short lane (``sync``) waits for the weights and may run
inside it, the session lends it the lock (it stays held: the watchdog and the version sync see
a task running) and waits until that task ends; its own steps then go on from the step the
other one left the weights at (:func:`~..training.session.train`, ``pause``).

A waiting task may run inside a paused one when neither changes the workers beyond their
weights and optimizers: the same data-parallel degree (no resize), no task heads, no shards of
their own, and the same sync settings (the replicas' sync state is the paused session's).
Otherwise it waits for the lock as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from dmsc.runtime.control.training.params import TrainParams

LANES = ("async", "sync")  # the long lane first: the lane that lends is the long one
LENDS = "async"  # the lane whose sessions lend the weights to the other's waiting tasks
POLL_S = 0.05


def nestable(params: TrainParams, dp: int) -> bool:
    """Whether a task with ``params`` may run inside a paused session, or pause for one, on a
    deployment of ``dp`` replicas."""
    sync = params.sync
    return (params.dp is None or params.dp == dp) and not (sync.task_heads or sync.local_data)


def fits(params: TrainParams, dp: int) -> Callable[[TrainParams], bool]:
    """Which waiting tasks may run inside a paused session of a task with ``params``."""

    def inside(other: TrainParams) -> bool:
        return nestable(other, dp) and other.sync == params.sync

    return inside


@dataclass
class _Ticket:
    params: TrainParams
    granted: bool = False
    done: bool = False


class Handoff:
    """The control plane's lock, taken by the lanes' consumers and lent between them."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self._cond = threading.Condition()
        self._waiting: list[_Ticket] = []

    @contextlib.contextmanager
    def hold(self, params: TrainParams | None = None) -> Iterator[None]:
        """Hold the weights for a task: the lock, or a loan from a paused session (``params``
        given: the task may run inside one)."""
        ticket = _Ticket(params) if params is not None else None
        own = False
        with self._cond:
            if ticket is not None:
                self._waiting.append(ticket)
        try:
            while True:
                if self.lock.acquire(timeout=POLL_S):
                    own = True
                    break
                with self._cond:
                    if ticket is not None and ticket.granted:
                        break
        finally:
            with self._cond:
                if ticket is not None and ticket in self._waiting:
                    self._waiting.remove(ticket)
        try:
            yield
        finally:
            if own:
                self.lock.release()
            else:
                assert ticket is not None
                with self._cond:
                    ticket.done = True
                    self._cond.notify_all()

    def lend(self, accepts: Callable[[TrainParams], bool]) -> bool:
        """Called by the holder between two steps: lend the weights to the first waiting task
        ``accepts`` and wait until it ends; whether one ran."""
        with self._cond:
            ticket = next((t for t in self._waiting if accepts(t.params)), None)
            if ticket is None:
                return False
            self._waiting.remove(ticket)
            ticket.granted = True
            self._cond.wait_for(lambda: ticket.done)
        return True


class Steps(Protocol):
    """What a pause reads and changes of the control plane: the step the weights are at."""

    steps_done: int


class Pausing:
    """A session's ``pause``: before a step, the weights' step goes on record and the weights
    are lent when a task waits (``lend``); after others trained, the task's first step moves
    with its steps (a resume after a crash counts them from there), stored by the session
    with the checkpoint it takes where the others left the weights."""

    def __init__(
        self, plane: Steps, lend: Callable[[], bool], task_id: int, params: TrainParams, first: int
    ) -> None:
        self.plane, self.lend, self.task_id, self.params, self.first = (
            plane,
            lend,
            task_id,
            params,
            first,
        )

    def __call__(self, step: int) -> tuple[int, dict[str, Any] | None]:
        """The step the weights are at after the loan, if any, and the task's parameters with
        its first step moved, for the session to store with its checkpoint there (stored
        before it, a crash in between left the task's newest checkpoint before its first step
        and the resume failed)."""
        self.plane.steps_done = step  # where a task run inside this one starts
        if not self.lend():
            return step, None
        self.first += self.plane.steps_done - step
        return self.plane.steps_done, {**self.params.as_json(), "first_step": self.first}
