"""A worker that still heartbeats but no longer answers: found by probing, then replaced."""

from __future__ import annotations

import time

from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.launch.recovery import heal
from dmsc.runtime.transport import logs
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")
TWO = [("embedding", "block_1"), ("block_2", "head")]


def test_a_stuck_worker_is_found_within_the_probe_deadline_and_replaced() -> None:
    layout = StageLayout(SPEC, TWO, faults={"stage1-r0": {"hang_health": 60}})
    with Deployment(layout, registry_ttl_s=3.0) as dep:
        time.sleep(1.5)
        assert dep.suspects() == {}  # alive, and its heartbeats keep coming
        t0 = time.monotonic()
        found = dep.probe(1.0)
        assert time.monotonic() - t0 < 2.5
        assert list(found) == [(1, 0)] and "Health" in found[(1, 0)]
        old_pid = dep.handle((1, 0)).process.pid
        rec = heal(dep, WorkerFailure(found, {}), 0, None)
        assert rec.failed == ["stage1-r0"] and dep.handle((1, 0)).process.pid != old_pid
        assert dep.probe(1.0) == {}  # the replacement answers (faults are the first one's)
        assert len(dep.generate(b"def ", 2)) == 2
        # each worker's logs are where a user looks for them (the deployment's home/logs)
        for h in dep.handles:
            assert h.config.log_file == str(logs.log_file(dep.home, h.config.sid))
            assert logs.stderr_file(dep.home, h.config.sid).is_file()
