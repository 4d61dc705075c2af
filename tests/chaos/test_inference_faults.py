"""A replica's stage worker killed (kill -9) during a stream of generation requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.spec import resolve_model
from dmsc.testing.chaos import serve_under_fault

SPEC = resolve_model("gpt-mini")
TWO = [("embedding", "block_1"), ("block_2", "head")]


@pytest.mark.parametrize("redundant", [False, True])
def test_every_request_is_answered_or_fails_clearly_within_its_deadline(redundant: bool) -> None:
    outcomes, fr = serve_under_fault(
        StageLayout(SPEC, TWO, replicas=2),
        requests=10,
        tokens=3,
        stage=1,
        kill_after=3,
        deadline_s=20.0,
        redundant=redundant,
    )
    assert len(outcomes) == 10 and all(o["seconds"] < 20.0 for o in outcomes)
    for o in outcomes:  # answered, or an error that names the failed stage
        assert "replica" in o or "stage 1" in o["error"], o
    # the other replica takes over: every request is answered, after the kill by replica 1
    assert fr.requests_failed == 0
    assert all(o["replica"] == 1 for o in outcomes[4:])
    # the failed call names it, before the registry's heartbeat timeout (3 s) could have
    assert fr.detected_after_s is not None and fr.detected_after_s < 3.0
    # healed: a replacement at a new epoch, and replica 0 serves again
    assert fr.recovered_after_s is not None and fr.extra["healed_serves"]


def test_a_frozen_worker_fails_its_request_within_the_failure_timeout(tmp_path: Path) -> None:
    """SIGSTOP a serving worker mid-stream: the request on its replica fails within the failure
    timeout (it was held 30 s), naming the stage, and the other replica serves meanwhile."""
    import logging
    import os
    import signal
    import threading
    import time

    from dmsc.data.db import Database
    from dmsc.runtime.control.launch.failures import WorkerFailure
    from dmsc.runtime.control.serving.inference import Replicas

    ttl = 2.0
    db = Database(f"sqlite:///{tmp_path / 'f.sqlite'}")
    with Deployment(StageLayout(SPEC, TWO, replicas=2), registry_ttl_s=ttl) as dep:
        replicas = Replicas(
            dep, db, threading.Lock(), logging.getLogger("t"), 1, token_timeout_s=ttl
        )
        assert len(replicas.infer_on("replica-0", "def ", 2)) == 2
        frozen = dep.handle((1, 0)).process.pid
        os.kill(frozen, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(WorkerFailure, match="stage 1"):
                replicas.infer_on("replica-0", "def ", 50)
            assert time.monotonic() - t0 < ttl + 10  # not the 50 tokens' 30 s of hold
            assert "replica-0" not in replicas.names()  # out of routing until healed
            assert len(replicas.infer_on("replica-1", "def ", 3)) == 3
        finally:
            os.kill(frozen, signal.SIGCONT)


def test_requests_on_one_replica_take_turns_per_token_and_stop_at_their_deadline() -> None:
    """A 4-token request behind a 400-token one on the same replica is answered long before the
    long one ends; a request past its deadline stops and frees the replica."""
    import logging
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from dmsc.data.db import Database
    from dmsc.runtime.control.launch.decoding import DeadlineExceeded
    from dmsc.runtime.control.serving.inference import Replicas

    with Deployment(StageLayout(SPEC, TWO, replicas=1)) as dep:
        replicas = Replicas(dep, Database("sqlite://"), threading.Lock(), logging.getLogger("t"), 1)
        replicas.infer_on("replica-0", "def ", 2)  # warm
        with ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            long = pool.submit(replicas.infer_on, "replica-0", "def ", 400, tenant="mallory")
            time.sleep(0.3)
            short = pool.submit(replicas.infer_on, "replica-0", "def ", 4, tenant="alice")
            short.result(timeout=60)
            answered = time.monotonic() - t0
            assert not long.done(), "the short request waited for the whole long one"
            long.result(timeout=120)
            assert answered < 0.5 * (time.monotonic() - t0)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            replicas.infer_on("replica-0", "def ", 1000, deadline=time.monotonic() + 0.5)
        assert time.monotonic() - t0 < 6.0  # 1,000 tokens take 10 s and more (100 s loaded)
        t0 = time.monotonic()
        assert len(replicas.infer_on("replica-0", "def ", 2)) == 2  # the replica is free
        assert time.monotonic() - t0 < 5.0
