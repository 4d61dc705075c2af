"""Plain lightpath requests on the optical network: the independent check of the optical layer.

Requests arrive as a Poisson process (rate = load, exponential holding times of mean 1), between
uniformly drawn node pairs, each for a bit rate drawn from ``gbit_s``; each is routed on the first
of the k shortest paths with a free run of the slots its bit rate needs at the path's modulation
(k-shortest-path first-fit, the RMSA baseline of DeepRMSA, Chen et al., JLT 2019), else blocked.
With one link and one slot per request this is an M/M/c/c queue: blocking follows Erlang B.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dmsc.sim.network import OpticalNetwork


def erlang_b(load: float, servers: int) -> float:
    """Blocking of an M/M/c/c queue (the recurrence B(k) = a B(k-1) / (k + a B(k-1)))."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


@dataclass(frozen=True)
class RMSAResult:
    load: float
    requests: int
    blocked: int
    mean_slot_utilization: float

    @property
    def blocking(self) -> float:
        return self.blocked / self.requests if self.requests else 0.0


def simulate_lightpaths(
    net: OpticalNetwork,
    load: float,
    requests: int,
    seed: int = 0,
    gbit_s: Sequence[float] = (100.0, 200.0, 400.0),
    pairs: Sequence[tuple[str, str]] | None = None,
    warmup_fraction: float = 0.1,
    fit: str = "first",
) -> RMSAResult:
    """Blocking probability of ``requests`` lightpath requests at ``load`` Erlang."""
    rng = np.random.default_rng(seed)
    all_pairs = list(pairs) if pairs is not None else list(itertools.permutations(net.sites, 2))
    gaps = rng.exponential(1.0 / load, size=requests)
    holds = rng.exponential(1.0, size=requests)
    which = rng.integers(len(all_pairs), size=requests)
    rates = rng.choice(np.asarray(gbit_s, dtype=float), size=requests)
    warmup = int(requests * warmup_fraction)
    heap: list[tuple[float, int, int]] = []  # (time, seq, lightpath id) departures
    seq = 0
    t = 0.0
    blocked = 0
    util_area = 0.0
    measured_from = None
    last = 0.0
    for i in range(requests):
        t += float(gaps[i])
        while heap and heap[0][0] <= t:
            when, _, lp = heapq.heappop(heap)
            if measured_from is not None:
                util_area += net.grid.utilization() * (when - last)
            last = when
            net.grid.release(lp)
        if measured_from is not None:
            util_area += net.grid.utilization() * (t - last)
        last = t
        if i == warmup:
            measured_from = t
        a, b = all_pairs[int(which[i])]
        placed = None
        for route in net.routes(a, b):
            placed = net.grid.setup(route.links, route.slots_for(float(rates[i])), fit)  # type: ignore[arg-type]
            if placed is not None:
                break
        if placed is None:
            blocked += i >= warmup
            continue
        heapq.heappush(heap, (t + float(holds[i]), seq, placed.id))
        seq += 1
    span = t - (measured_from or 0.0)
    return RMSAResult(load, requests - warmup, blocked, util_area / span if span > 0 else 0.0)
