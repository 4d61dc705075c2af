"""Detection's Health round, read while a recovery on another thread changes the deployment
(dmsc.runtime.control.launch.failures)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from dmsc.runtime.control.launch import failures


class _Worker:
    def __init__(self, meanwhile: Any = None) -> None:
        self.meanwhile = meanwhile

    def send_future(self, method: str, msg: Any, timeout_s: float) -> Future[bytes]:
        if self.meanwhile is not None:
            self.meanwhile()
        done: Future[bytes] = Future()
        done.set_result(b"{}")
        return done


def test_a_worker_taken_out_while_the_round_runs_is_silent_not_an_error() -> None:
    """The keys are read first, then each worker asked: one a recovery took out in between
    used to raise KeyError out of ``dmsc status``."""
    clients: dict[tuple[int, int], Any] = {}
    clients[(0, 0)] = _Worker(meanwhile=lambda: clients.pop((1, 0)))
    clients[(1, 0)] = _Worker()
    answers, silent = failures.health(SimpleNamespace(clients=clients), 1.0)  # type: ignore[arg-type]
    assert answers == {(0, 0): {}}
    assert list(silent) == [(1, 0)] and "taken out" in silent[(1, 0)]
