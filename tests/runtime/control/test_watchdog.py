"""The watchdog's choice of what to heal at ep > 1 (no workers: the bookkeeping alone; the
heals themselves run on real workers in tests/chaos/test_checkpoint_faults.py)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from dmsc.runtime.control import watchdog
from dmsc.runtime.control.launch.failures import Key, WorkerFailure


def _plane(found: dict[Key, str], down: set[int], ep: int = 2) -> Any:
    """A control plane of four replicas of one stage at ``ep``, ``found`` failed, ``down`` out
    of routing; what it heals and asks goes to ``cp.healed`` and ``cp.asked``."""
    cp = SimpleNamespace(healed=[], asked=[], undeployed=None, unrestored=set())

    class Worker:
        def __init__(self, key: Key) -> None:
            self.key = key

        def send(self, *_: Any, **__: Any) -> None:
            cp.asked.append(self.key)

    cp.deployment = SimpleNamespace(
        layout=SimpleNamespace(ep=ep),
        suspects=lambda: dict(found),
        probe=lambda _timeout_s: {},
        registry=SimpleNamespace(ttl_s=1.0),
        handles=[],
        clients={(0, r): Worker((0, r)) for r in range(4)},
        instance=lambda r: [(0, x) for x in range(r - r % ep, r - r % ep + ep)],
    )
    cp.inference = SimpleNamespace(
        down=set(down),
        locks=[threading.Lock() for _ in range(4)],
        healed=lambda r: cp.inference.down.discard(r),
    )
    cp.db = SimpleNamespace(add=lambda _row: None)
    cp.run = SimpleNamespace(id=1)
    cp.log = logging.getLogger("test-watchdog")
    cp.checkpoints = list
    cp.record_refused = cp.record_services = lambda *_: None
    return cp


@pytest.fixture
def heals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, set[Key]]]:
    """The (replica, failed workers) of each heal, each one successful."""
    done: list[tuple[int, set[Key]]] = []

    def heal(_dep: Any, failure: WorkerFailure, r: int, _candidates: Any) -> Any:
        done.append((r, set(failure.failed)))
        return SimpleNamespace(lost=False, failed=[], restored=SimpleNamespace(refused=[]))

    monkeypatch.setattr(watchdog.recovery, "heal", heal)
    monkeypatch.setattr(watchdog, "fault_record", lambda *_: None)
    return done


def test_a_failed_replica_heals_its_expert_parallel_group_as_the_group_it_serves(
    heals: list[tuple[int, set[Key]]],
) -> None:
    # replica 3 failed at ep = 2: the instance routed to is replica-2 (replicas 2 and 3), so
    # that is the one healed and back in routing (it healed replica 3 alone, left 2 down)
    cp = _plane({(0, 3): "exited"}, down={2})
    watchdog.heal_once(cp)
    assert heals == [(2, {(0, 3)})] and cp.inference.down == set()


def test_a_group_marked_down_but_alive_is_asked_whole_and_comes_back(
    heals: list[tuple[int, set[Key]]],
) -> None:
    cp = _plane({}, down={2})
    watchdog.heal_once(cp)
    assert not heals and cp.asked == [(0, 2), (0, 3)] and cp.inference.down == set()
