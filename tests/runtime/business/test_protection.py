from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.runtime.business.protection import (
    BreakerState,
    CircuitBreaker,
    RateLimiter,
    TenantAdmission,
    TokenBucket,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_by_hand() -> None:
    c = Clock()
    b = TokenBucket(rate=2, burst=3, clock=c)
    assert [b.take()[0] for _ in range(4)] == [True, True, True, False]
    ok, wait = b.take()
    assert not ok and wait == pytest.approx(0.5)
    c.t = 0.5
    assert b.take() == (True, 0.0)
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


@settings(deadline=None, max_examples=50)
@given(st.floats(0.5, 50), st.integers(1, 20), st.integers(1, 200))
def test_admitted_share_matches_the_rate(rate: float, burst: int, seconds: int) -> None:
    """Offered 10x the rate for ``seconds``: admitted = burst + rate x time, less what the cap
    wastes between arrivals (at most one arrival's worth of tokens, 1/10, per admission)."""
    c = Clock()
    lim = RateLimiter(rate, burst, c)
    admitted = 0
    steps = int(seconds * rate * 10)
    for i in range(steps):
        c.t = i / (rate * 10)
        admitted += lim.check("alice")[0]
    expected = min(steps, burst + rate * c.t)  # never more than was offered
    assert expected * 10 / 11 - 1 <= admitted <= expected + 1


def test_tenants_have_their_own_buckets_and_retry_after() -> None:
    c = Clock()
    lim = RateLimiter(rate=1, burst=1, clock=c)
    assert lim.check("a") == (True, 0)
    ok, retry = lim.check("a")
    assert not ok and retry == 1
    assert lim.check("b") == (True, 0)


def test_breaker_transitions() -> None:
    c = Clock()
    br = CircuitBreaker(threshold=3, reset_s=10, probes=1, clock=c)
    for _ in range(2):
        assert br.allow()
        br.failure()
    assert br.state is BreakerState.CLOSED
    br.success()  # resets the count
    for _ in range(3):
        br.allow()
        br.failure()
    assert br.state is BreakerState.OPEN and not br.allow()
    c.t = 9.9
    assert not br.allow()
    c.t = 10
    assert br.allow() and br.state is BreakerState.HALF_OPEN
    assert not br.allow()  # one probe at a time
    br.failure()
    assert br.state is BreakerState.OPEN and br.opened_at == 10
    c.t = 20
    assert br.allow()
    br.success()
    assert br.state is BreakerState.CLOSED and br.allow()


def test_a_tenant_is_refused_past_its_requests_or_its_cost_and_others_are_not() -> None:
    adm = TenantAdmission(max_requests=2, max_cost=100)
    assert adm.enter("a", 40) is None and adm.enter("a", 40) is None
    assert "2 requests in flight" in (adm.enter("a", 1) or "")
    assert adm.enter("b", 100) is None  # another tenant has its own allowance
    adm.leave("a", 40)
    assert "cost in flight" in (adm.enter("a", 70) or "")  # 40 + 70 > 100
    assert adm.enter("a", 60) is None
    adm.leave("a", 40)
    adm.leave("a", 60)
    adm.leave("b", 100)
    assert adm.in_flight("a") == (0, 0.0) and adm.in_flight("b") == (0, 0.0)


def test_a_request_costlier_than_the_whole_allowance_is_refused_with_the_reason() -> None:
    assert "at most 100" in (TenantAdmission(4, 100).enter("a", 101) or "")
    with pytest.raises(ValueError):
        TenantAdmission(0, 1)
