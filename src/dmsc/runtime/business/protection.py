"""Protection of backends: per-tenant token-bucket rate limits and per-backend circuit breakers.

Both are pure state machines over a clock they are given (never ``time.time()`` inside), so the
gateway runs them on wall time and the simulator on simulated time. Libraries such as ``limits``
or ``pybreaker`` read the system clock themselves, which is why these few lines are ours.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

Clock = Callable[[], float]


@dataclass
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up."""

    rate: float
    burst: float
    clock: Clock = time.monotonic
    tokens: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.tokens = self.burst
        self.stamp = self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, cost: float = 1.0) -> tuple[bool, float]:
        """(allowed, seconds until it would be): take ``cost`` tokens if there are enough."""
        self._refill()
        if self.tokens >= cost:
            self.tokens -= cost
            return True, 0.0
        return False, (cost - self.tokens) / self.rate


class RateLimiter:
    """One token bucket per tenant. Thread-safe (the gateway checks from its event loop and
    from its thread pool)."""

    def __init__(self, rate: float, burst: float, clock: Clock = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def check(
        self,
        tenant: str,
        cost: float = 1.0,
        rate: float | None = None,
        burst: float | None = None,
    ) -> tuple[bool, int]:
        """(allowed, Retry-After in whole seconds, at least 1 when refused). ``rate`` and
        ``burst``: the tenant's own limit (its key's), instead of the limiter's."""
        rate, burst = rate or self.rate, burst or self.burst
        with self._lock:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                bucket = self._buckets[tenant] = TokenBucket(rate, burst, self.clock)
            elif (bucket.rate, bucket.burst) != (rate, burst):  # the key's limit changed
                bucket.rate, bucket.burst = rate, burst
                bucket.tokens = min(bucket.tokens, burst)
            ok, wait = bucket.take(cost)
        return ok, 0 if ok else max(1, math.ceil(wait))


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """Closed until ``threshold`` consecutive failures; open (refusing) for ``reset_s``; then
    half-open: ``probes`` trial calls, closed again if they succeed, open again if one fails."""

    threshold: int = 5
    reset_s: float = 10.0
    probes: int = 1
    clock: Clock = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    in_flight_probes: int = 0

    def allow(self) -> bool:
        if self.state is BreakerState.OPEN:
            if self.clock() - self.opened_at < self.reset_s:
                return False
            self.state = BreakerState.HALF_OPEN
            self.in_flight_probes = 0
        if self.state is BreakerState.HALF_OPEN:
            if self.in_flight_probes >= self.probes:
                return False
            self.in_flight_probes += 1
        return True

    def success(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.in_flight_probes -= 1
            if self.in_flight_probes <= 0:
                self.state = BreakerState.CLOSED
        self.failures = 0

    def failure(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._open()
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = self.clock()
        self.failures = 0
        self.in_flight_probes = 0


@dataclass
class TenantAdmission:
    """How much work each tenant may have in flight at once: at most ``max_requests`` requests
    and ``max_cost`` cost units (a request's cost is what it asks of the replicas: tokens x
    stages). A request over either limit is refused at once (429), never queued, so one
    tenant's burst cannot take the capacity (threads, replicas) the other tenants need; the
    rate limit bounds how fast requests come, this bounds how much runs at once. Not
    thread-safe: the gateway uses it from its event loop only."""

    max_requests: int = 4
    max_cost: float = 4096.0
    _requests: dict[str, int] = field(default_factory=dict)
    _cost: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_requests <= 0 or self.max_cost <= 0:
            raise ValueError("max_requests and max_cost must be positive")

    def enter(self, tenant: str, cost: float) -> str | None:
        """Admit a request of ``cost`` for ``tenant`` (None), or the reason it is refused."""
        if cost > self.max_cost:
            return f"a request may cost at most {self.max_cost:g} (tokens x stages), not {cost:g}"
        n, c = self._requests.get(tenant, 0), self._cost.get(tenant, 0.0)
        if n + 1 > self.max_requests:
            return f"tenant {tenant!r} has {n} requests in flight (limit {self.max_requests})"
        if c + cost > self.max_cost:
            return (
                f"tenant {tenant!r} has {c:g} cost in flight; {cost:g} more would pass "
                f"its limit of {self.max_cost:g} (tokens x stages)"
            )
        self._requests[tenant], self._cost[tenant] = n + 1, c + cost
        return None

    def leave(self, tenant: str, cost: float) -> None:
        """A request admitted by :meth:`enter` finished."""
        n = self._requests[tenant] - 1
        if n:
            self._requests[tenant], self._cost[tenant] = n, self._cost[tenant] - cost
        else:  # no entry left behind for a tenant with nothing in flight
            del self._requests[tenant], self._cost[tenant]

    def in_flight(self, tenant: str) -> tuple[int, float]:
        return self._requests.get(tenant, 0), self._cost.get(tenant, 0.0)
