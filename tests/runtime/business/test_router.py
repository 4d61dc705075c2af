from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.runtime.business.router import (
    ConsistentHash,
    LatencyAware,
    LeastOutstanding,
    NoReplica,
    PowerOfTwo,
    RoundRobin,
)

REPLICAS = [f"r{i}" for i in range(5)]


@given(st.integers(1, 8), st.integers(1, 60))
def test_round_robin_is_even(n: int, rounds: int) -> None:
    reps = REPLICAS[:n] if n <= 5 else [f"x{i}" for i in range(n)]
    rr = RoundRobin()
    counts = Counter(rr.choose(reps) for _ in range(n * rounds))
    assert set(counts.values()) == {rounds}


def test_failover_excludes() -> None:
    rr = RoundRobin()
    assert all(rr.choose(REPLICAS, exclude={"r0", "r1"}) not in {"r0", "r1"} for _ in range(10))
    with pytest.raises(NoReplica):
        rr.choose(REPLICAS, exclude=set(REPLICAS))


def test_least_outstanding_balances_in_flight() -> None:
    lo = LeastOutstanding()
    for _ in range(10):
        lo.started(lo.choose(REPLICAS))
    assert set(lo.outstanding.values()) == {2}
    lo.finished("r3", 0.1)
    assert lo.choose(REPLICAS) == "r3"


def test_latency_aware_prefers_the_fast() -> None:
    la = LatencyAware()
    for r, lat in zip(REPLICAS, [0.5, 0.1, 0.3, 0.2, 0.4], strict=True):
        la.finished(r, lat)
    assert la.choose(REPLICAS) == "r1"
    la.finished("r1", 0.1, ok=False)  # a failure counts as slow
    assert la.choose(REPLICAS) == "r3"


@settings(max_examples=30)
@given(st.integers(0, 10_000))
def test_power_of_two_keeps_the_spread_small(seed: int) -> None:
    p2 = PowerOfTwo(seed)
    for _ in range(500):
        p2.started(p2.choose(REPLICAS))
    loads = [p2.outstanding.get(r, 0) for r in REPLICAS]
    assert max(loads) - min(loads) <= 8  # worst over 3,000 seeds: 6; uniform random: ~23


def test_sticky_sessions_move_only_the_leaving_share() -> None:
    ch = ConsistentHash()
    keys = [f"session-{i}" for i in range(4000)]
    before = {k: ch.choose(REPLICAS, key=k) for k in keys}
    assert all(ch.choose(REPLICAS, key=k) == v for k, v in before.items())  # stable
    counts = Counter(before.values())
    assert min(counts.values()) > 4000 / 5 * 0.6  # roughly even with 64 virtual nodes
    after = {k: ch.choose(REPLICAS, key=k, exclude={"r2"}) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "r2" for k in moved)  # only r2's sessions move
    grown = {k: ch.choose([*REPLICAS, "r5"], key=k) for k in keys}
    moved_in = [k for k in keys if grown[k] != before[k]]
    assert all(grown[k] == "r5" for k in moved_in)
    assert len(moved_in) < 4000 / 6 * 1.5
