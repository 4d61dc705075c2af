"""Plain lightpath requests on the optical network: the RMSA experiment of the literature.

Requests arrive as a Poisson process (rate = load, exponential holding times of mean 1), between
uniformly drawn node pairs, each for a bit rate drawn from a distribution (:class:`BitRates`);
each is routed on the first of the k shortest paths with a free run of the slots its bit rate
needs at the path's modulation, plus the guard band (k-shortest-path first-fit, KSP-FF, the RMSA
baseline of DeepRMSA, Chen et al., JLT 2019; other spectrum fits are settings), else blocked.
The first ``warmup`` requests fill the network and are not counted. Service blocking is the
share of requests blocked, bandwidth blocking the share of the requested Gbit/s blocked.
With one link and one slot per request this is an M/M/c/c queue: blocking follows Erlang B.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dmsc.sim import fragmentation
from dmsc.sim.network import OpticalNetwork


def erlang_b(load: float, servers: int) -> float:
    """Blocking of an M/M/c/c queue (the recurrence B(k) = a B(k-1) / (k + a B(k-1)))."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


@dataclass(frozen=True)
class BitRates:
    """A distribution of requested bit rates (Gbit/s): integers drawn uniformly from
    ``[low, high]``, or ``values`` drawn with ``weights`` (equal when None)."""

    values: tuple[float, ...] = ()
    weights: tuple[float, ...] | None = None
    uniform: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.uniform is not None:
            low, high = self.uniform
            if not 0 < low <= high:
                raise ValueError(f"uniform:{low}:{high} needs 0 < low <= high")
        elif not self.values or any(not v > 0 for v in self.values):
            raise ValueError("bit rates must be positive numbers")
        elif self.weights is not None and (
            len(self.weights) != len(self.values) or any(not w > 0 for w in self.weights)
        ):
            raise ValueError("one positive weight per bit rate")

    @classmethod
    def parse(cls, text: str) -> BitRates:
        """``uniform:A:B`` (integers A..B), or ``R1,R2,...`` with optional ``=WEIGHT`` each."""
        text = text.strip()
        if text.startswith("uniform:"):
            parts = text.split(":")
            if len(parts) != 3 or not all(p.strip().isdigit() for p in parts[1:]):
                raise ValueError(f"expected uniform:LOW:HIGH (integers), got {text!r}")
            return cls(uniform=(int(parts[1]), int(parts[2])))
        values, weights = [], []
        for item in (x.strip() for x in text.split(",") if x.strip()):
            rate, eq, weight = item.partition("=")
            try:
                values.append(float(rate))
                weights.append(float(weight) if eq else 1.0)
            except ValueError:
                raise ValueError(f"expected RATE or RATE=WEIGHT, got {item!r}") from None
        if not values:
            raise ValueError("names no bit rate")
        return cls(tuple(values), tuple(weights))

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.uniform is not None:
            return rng.integers(self.uniform[0], self.uniform[1] + 1, size=n).astype(float)
        p = None
        if self.weights is not None:
            p = np.asarray(self.weights, dtype=float) / sum(self.weights)
        return rng.choice(np.asarray(self.values, dtype=float), size=n, p=p)


@dataclass(frozen=True)
class RMSAResult:
    load: float
    requests: int  # counted (after the warm-up)
    blocked: int
    mean_slot_utilization: float
    gbit_s_requested: float = 0.0
    gbit_s_blocked: float = 0.0
    seconds: float = 0.0  # wall time of the whole run, warm-up included
    handled: int = 0  # requests handled, warm-up included
    # sampled every ``sample_every`` requests after the warm-up (see dmsc.sim.fragmentation)
    samples: tuple[fragmentation.Sample, ...] = ()
    link_utilization: tuple[float, ...] = ()  # per fiber, the mean over the samples
    snapshot: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def blocking(self) -> float:
        """Service blocking probability: the share of requests blocked."""
        return self.blocked / self.requests if self.requests else 0.0

    @property
    def bandwidth_blocking(self) -> float:
        """The share of the requested bit rate blocked."""
        return self.gbit_s_blocked / self.gbit_s_requested if self.gbit_s_requested else 0.0

    @property
    def us_per_request(self) -> float:
        return self.seconds / self.handled * 1e6 if self.handled else 0.0


def simulate_lightpaths(
    net: OpticalNetwork,
    load: float,
    requests: int,
    seed: int = 0,
    gbit_s: BitRates | Sequence[float] = (100.0, 200.0, 400.0),
    pairs: Sequence[tuple[str, str]] | None = None,
    warmup_fraction: float = 0.1,
    fit: str = "first",
    warmup: int | None = None,
    sample_every: int = 0,
    snapshot_at: int | None = None,
) -> RMSAResult:
    """Blocking of lightpath requests at ``load`` Erlang: ``requests`` in all, of which the
    first ``warmup`` (default: ``warmup_fraction`` of them) are not counted. With
    ``sample_every``, the fragmentation figures every that many requests after the warm-up;
    with ``snapshot_at``, the spectrum's occupancy when that request arrives."""
    rng = np.random.default_rng(seed)
    net.grid.rng.seed(seed)  # random fit's draws
    rates_of = gbit_s if isinstance(gbit_s, BitRates) else BitRates(tuple(gbit_s))
    all_pairs = list(pairs) if pairs is not None else list(itertools.permutations(net.sites, 2))
    gaps = rng.exponential(1.0 / load, size=requests)
    holds = rng.exponential(1.0, size=requests)
    which = rng.integers(len(all_pairs), size=requests)
    rates = rates_of.draw(rng, requests)
    skip = int(requests * warmup_fraction) if warmup is None else warmup
    if not 0 <= skip < requests:
        raise ValueError(f"warm-up of {skip} requests leaves none of {requests} to count")
    routes = {pair: net.routes(*pair) for pair in set(all_pairs)}
    grid = net.grid
    heap: list[tuple[float, int]] = []  # (time, lightpath id) departures
    t = last = 0.0
    blocked = 0
    asked = refused = util_area = 0.0
    measured_from = None
    samples: list[fragmentation.Sample] = []
    per_link = np.zeros(len(net.link_ends))
    shot = None
    t_wall = time.perf_counter()
    for i in range(requests):
        t += float(gaps[i])
        while heap and heap[0][0] <= t:
            when, lp = heapq.heappop(heap)
            if measured_from is not None:
                util_area += grid.utilization() * (when - last)
            last = when
            grid.release(lp)
        if measured_from is not None:
            util_area += grid.utilization() * (t - last)
        last = t
        if i == skip:
            measured_from = t
        if sample_every and i >= skip and (i - skip) % sample_every == 0:
            samples.append(fragmentation.sample(grid, i, t))
            per_link += fragmentation.link_utilization(grid)
        if i == snapshot_at:
            shot = fragmentation.snapshot(grid)
        rate = float(rates[i])
        placed = None
        for route in routes[all_pairs[int(which[i])]]:
            placed = grid.setup(route.links, route.slots_for(rate), fit)  # type: ignore[arg-type]
            if placed is not None:
                break
        if i >= skip:
            asked += rate
        if placed is None:
            if i >= skip:
                blocked += 1
                refused += rate
            continue
        heapq.heappush(heap, (t + float(holds[i]), placed.id))
    seconds = time.perf_counter() - t_wall
    span = t - (measured_from or 0.0)
    return RMSAResult(
        load,
        requests - skip,
        blocked,
        util_area / span if span > 0 else 0.0,
        asked,
        refused,
        seconds,
        requests,
        tuple(samples),
        tuple(float(x) for x in per_link / max(1, len(samples))) if samples else (),
        shot,
    )
