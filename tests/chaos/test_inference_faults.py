"""A replica's stage worker killed (kill -9) during a stream of generation requests."""

from __future__ import annotations

import pytest

from dmsc.runtime.control.chaos import serve_under_fault
from dmsc.runtime.control.deployment import StageLayout
from dmsc.spec import resolve_model

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
    assert fr.detected_after_s is not None and fr.detected_after_s < 2.0
    # healed: a replacement at a new epoch, and replica 0 serves again
    assert fr.recovered_after_s is not None and fr.extra["healed_serves"]
