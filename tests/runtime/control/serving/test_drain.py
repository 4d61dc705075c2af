"""The gate a replica shuts while a model version loads into it, and at ep > 1 the replicas
that are routed to and loaded (no workers: the counting alone;
tests/runtime/control/serving/test_version_sync.py loads versions on real workers)."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from dmsc.runtime.control.launch.decoding import Cancelled, DeadlineExceeded
from dmsc.runtime.control.serving.inference import Replicas


def replicas(count: int, ep: int = 1) -> Replicas:
    dep: Any = SimpleNamespace(layout=SimpleNamespace(replicas=count, ep=ep, tokens_in_flight=1))
    return Replicas(dep, db=None, lock=threading.Lock(), log=logging.getLogger("t"), run_id=1)  # type: ignore[arg-type]


def _under_way(rep: Replicas, name: str, for_s: float) -> threading.Event:
    """A request admitted to replica ``name`` now, which ends ``for_s`` seconds later: the
    event that lets it end (set before it leaves the replica)."""
    release, admitted = threading.Event(), threading.Event()

    def request() -> None:
        with rep.admitted([name]):
            admitted.set()
            release.wait(30)

    threading.Thread(target=request, daemon=True).start()
    assert admitted.wait(30)
    threading.Timer(for_s, release.set).start()
    return release


def test_new_requests_go_elsewhere_or_wait_and_the_load_waits_for_those_in_flight() -> None:
    rep = replicas(2)
    rep.drain_timeout_s = 30.0
    released = _under_way(rep, "replica-0", 0.3)
    with rep.drained("replica-0", "loading version 2") as left:
        # it waited for the request (which ends only once released; timed, a late wake-up of
        # this thread after the timer started could make the wait look short)
        assert left == 0 and released.is_set()
        assert rep.names() == ["replica-1"]  # new requests go to the other replica
        with pytest.raises(DeadlineExceeded), rep.admitted(["replica-0"], time.monotonic() + 0.2):
            pass
        cancel = threading.Event()
        threading.Timer(0.2, cancel.set).start()
        with pytest.raises(Cancelled), rep.admitted(["replica-1", "replica-0"], cancel=cancel):
            pass
        assert rep.in_flight() == 0  # the ones refused at the gate were never counted
    assert rep.names() == ["replica-0", "replica-1"]


def test_a_drain_gives_up_after_its_timeout_and_a_lone_replica_stays_routed() -> None:
    rep = replicas(1)
    rep.drain_timeout_s = 0.2
    with rep.admitted(["replica-0"]), rep.drained("replica-0", "loading version 2") as left:
        assert left == 1
        assert rep.names() == ["replica-0"]  # none other: its requests wait at the gate
    with rep.admitted(["replica-0"]):  # the gate is open again
        assert rep.in_flight("replica-0") == 1


def test_a_move_shuts_every_gate_at_once_and_waits_for_the_requests_in_flight() -> None:
    rep = replicas(2)
    released = _under_way(rep, "replica-1", 0.3)
    with rep.paused("a move", 30.0) as left:
        assert left == 0 and released.is_set()  # it waited for the request
        # no replica takes a new request: they wait at the gates until the move is done
        with pytest.raises(DeadlineExceeded), rep.admitted(["replica-0"], time.monotonic() + 0.2):
            pass
    with rep.admitted(["replica-0"]), rep.paused("a move", 0.2) as left:
        assert left == 1  # still in flight after the wait: the caller defers the move
    assert rep.in_flight() == 0


def test_the_answered_requests_latencies_are_kept_for_the_control_loop() -> None:
    """Every door's requests pass the gate, the gateway's too (they are no task rows): the
    control loop's inference objective reads their latencies here."""
    rep = replicas(1)
    t0 = time.time()
    with rep.admitted(["replica-0"]):
        time.sleep(0.05)
    with pytest.raises(RuntimeError), rep.admitted(["replica-0"]):
        raise RuntimeError("the replica failed")  # not answered: not kept
    (latency,) = rep.answered_since(t0)
    assert 0.05 <= latency < 5
    assert rep.answered_since(time.time() + 1) == []


def test_an_expert_parallel_group_is_routed_as_one_replica() -> None:
    # ep = 2 over four replicas: a request runs on both replicas of a group (their mixtures
    # exchange tokens), so each group is one instance, named by its first replica
    rep = replicas(4, ep=2)
    assert rep.instances == [0, 2] and rep.names() == ["replica-0", "replica-2"]
    with rep.drained("replica-2", "loading version 2"):
        assert rep.names() == ["replica-0"]
    with rep.paused("a move", 1.0) as left:  # every instance's gate
        assert left == 0 and rep.names() == ["replica-0", "replica-2"]  # none other: wait
        with pytest.raises(DeadlineExceeded), rep.admitted(["replica-2"], time.monotonic() + 0.2):
            pass


def test_a_gray_release_loads_the_canary_into_the_last_expert_parallel_group_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ep = 2 over four replicas: the canary goes to replica-2 (replicas 2 and 3, loaded
    # together: version_sync.load takes Deployment.instance), not to replica 3 alone
    from dmsc.runtime.control.serving import version_sync

    rep = replicas(4, ep=2)
    production, canary = (
        SimpleNamespace(id=1, status="production"),
        SimpleNamespace(id=2, status="canary"),
    )
    rep.db = SimpleNamespace(model_versions=lambda: [production, canary])  # type: ignore[assignment]
    loaded: list[tuple[str, int]] = []
    monkeypatch.setattr(
        version_sync, "load", lambda _rep, name, v, _all: loaded.append((name, v.id)) or True
    )
    rep.sync_versions()
    assert loaded == [("replica-0", 1), ("replica-2", 2)]
