"""One tenant cannot make the autoscaler start and stop pipelines at its pace (issue 29, item
17): bursts every 25 s used to take the deployment to its maximum and back each time; a replica
now goes only once a minute of load (the scale-in window, at the default settings) fits in one
fewer, so the bursts keep the replicas up instead of churning them."""

from __future__ import annotations

from collections.abc import Callable

from dmsc.runtime.control.serving.autoscale import ScalePolicy
from dmsc.runtime.transport.messages import AutoscaleSettings


def _run(load: Callable[[int], int], seconds: int) -> list[tuple[int, int]]:
    """(time, replicas) after each change, sampling once a second."""
    policy = ScalePolicy(AutoscaleSettings())  # min 1, max 4, target 2, cooldown 10, window 5
    current, changes = 1, []
    for t in range(seconds):
        wanted = policy.observe(float(t), load(t), current)
        if wanted != current:
            current = wanted
            policy.changed(float(t))
            changes.append((t, current))
    return changes


def test_bursts_every_25_s_from_one_tenant_do_not_churn_replicas() -> None:
    changes = _run(lambda t: 8 if t % 25 < 12 else 0, 300)  # 8 in flight for 12 s of every 25
    before = [1] + [n for _, n in changes]
    removals = [(t, n) for (t, n), was in zip(changes, before, strict=False) if n < was]
    assert len(removals) == 0, changes  # the replicas stay up between the bursts
    assert max(n for _, n in changes) <= 4 and len(changes) <= 3, changes


def test_the_load_going_away_for_good_still_removes_the_replicas() -> None:
    changes = _run(lambda t: 8 if t < 40 else 0, 200)
    assert changes[-1][1] == 1, changes  # back to the minimum
    before = [1] + [n for _, n in changes]
    first_removal = next(t for (t, n), was in zip(changes, before, strict=False) if n < was)
    assert first_removal >= 40 + 60, changes  # after a minute of quiet, not at once
