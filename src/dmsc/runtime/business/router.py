"""The service router: which replica of a stage serves a request.

Policies share one small interface and take their clock and randomness from the caller:
round robin, least outstanding requests, latency-aware (exponentially weighted moving average),
power of two choices (seeded) and sticky sessions (consistent hashing with virtual nodes, so a
replica joining or leaving moves only its share of sessions). ``exclude`` lets the caller fail
over to another replica.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from dmsc.data.db import ModelVersionRecord


class Router(Protocol):
    """Chooses a replica; told when requests start and finish."""

    def choose(
        self, replicas: Sequence[str], key: str | None = None, exclude: Collection[str] = ()
    ) -> str: ...

    def started(self, replica: str) -> None: ...

    def finished(self, replica: str, latency_s: float, ok: bool = True) -> None: ...


class NoReplica(LookupError):
    """Every replica is excluded (or there is none)."""


def _candidates(replicas: Sequence[str], exclude: Collection[str]) -> list[str]:
    out = [r for r in replicas if r not in exclude]
    if not out:
        raise NoReplica("no replica available")
    return out


class _Base:
    def started(self, replica: str) -> None:
        return None

    def finished(self, replica: str, latency_s: float, ok: bool = True) -> None:
        return None


class RoundRobin(_Base):
    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, replicas: Sequence[str], key: str | None = None, exclude: Collection[str] = ()
    ) -> str:
        cands = _candidates(replicas, exclude)
        choice = cands[self._next % len(cands)]
        self._next += 1
        return choice


class LeastOutstanding(_Base):
    def __init__(self) -> None:
        self.outstanding: dict[str, int] = {}

    def choose(
        self, replicas: Sequence[str], key: str | None = None, exclude: Collection[str] = ()
    ) -> str:
        cands = _candidates(replicas, exclude)
        return min(cands, key=lambda r: (self.outstanding.get(r, 0), cands.index(r)))

    def started(self, replica: str) -> None:
        self.outstanding[replica] = self.outstanding.get(replica, 0) + 1

    def finished(self, replica: str, latency_s: float, ok: bool = True) -> None:
        self.outstanding[replica] = max(0, self.outstanding.get(replica, 0) - 1)


class LatencyAware(_Base):
    """The replica with the lowest moving-average latency (unknown ones first)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.ewma: dict[str, float] = {}

    def choose(
        self, replicas: Sequence[str], key: str | None = None, exclude: Collection[str] = ()
    ) -> str:
        cands = _candidates(replicas, exclude)
        return min(cands, key=lambda r: (self.ewma.get(r, 0.0), cands.index(r)))

    def finished(self, replica: str, latency_s: float, ok: bool = True) -> None:
        sample = latency_s if ok else latency_s * 10  # a failure counts as a very slow answer
        old = self.ewma.get(replica)
        self.ewma[replica] = sample if old is None else (1 - self.alpha) * old + self.alpha * sample


class PowerOfTwo(LeastOutstanding):
    """Two replicas at random (seeded), the less loaded of them."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def choose(
        self, replicas: Sequence[str], key: str | None = None, exclude: Collection[str] = ()
    ) -> str:
        cands = _candidates(replicas, exclude)
        if len(cands) == 1:
            return cands[0]
        a, b = self.rng.sample(cands, 2)
        return a if self.outstanding.get(a, 0) <= self.outstanding.get(b, 0) else b


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ConsistentHash(_Base):
    """Sticky sessions: a key always maps to the same replica while it stays up."""

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}
        self._rr = RoundRobin()

    def _ring(self, replicas: Sequence[str]) -> tuple[list[int], list[str]]:
        key = tuple(sorted(replicas))
        if key not in self._rings:
            points = sorted((_hash(f"{r}#{v}"), r) for r in key for v in range(self.vnodes))
            self._rings[key] = ([p for p, _ in points], [r for _, r in points])
        return self._rings[key]

    def choose(
        self, replicas: Sequence[str], key: str | None = None, exclude: Collection[str] = ()
    ) -> str:
        cands = _candidates(replicas, exclude)
        if key is None:
            return self._rr.choose(cands)
        hashes, owners = self._ring(cands)
        i = bisect.bisect(hashes, _hash(key)) % len(hashes)
        return owners[i]


POLICIES: dict[str, Callable[[], Router]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "latency": LatencyAware,
    "p2c": PowerOfTwo,
    "sticky": ConsistentHash,
}


def pick_version(all_versions: list[ModelVersionRecord], key: str) -> ModelVersionRecord | None:
    """The version that serves the request identified by ``key`` (gray release): the canary
    takes its percentage of traffic, decided by a hash of ``key`` (the session, sticky, or the
    request id), so the split is exact over many requests and stable for one session."""
    production = next((v for v in all_versions if v.status == "production"), None)
    canary_v = next((v for v in all_versions if v.status == "canary"), None)
    if canary_v is not None:
        bucket = (
            int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % 10_000
        )
        if bucket < canary_v.canary_percent * 100:
            return canary_v
    return production
