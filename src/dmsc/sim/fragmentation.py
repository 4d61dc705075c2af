"""How fragmented a spectrum is: the figures elastic-optical-network studies plot over time.

For one fiber of ``n`` slots, cut into maximal runs of free and of held slots:

- **external fragmentation**: ``1 - largest free run / free slots`` (0 when the free slots are
  one run or there are none; towards 1 when they are scattered in small runs);
- **spectrum entropy**: ``-sum(len/n * ln(len/n))`` over all runs, free and held (Wright, Parker
  and Lord, JOCN 2015): 0 for an empty or full fiber, higher the more runs it is cut into.

A network's figure is the mean over its fibers. :func:`snapshot` is the occupancy (links x
slots: the lightpath holding each slot, -1 free) for a heat map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dmsc.sim.spectrum import SpectrumGrid, runs


def external_fragmentation(free: int) -> float:
    """Of one fiber's free-slot mask."""
    lengths = [length for _, length in runs(free)]
    total = sum(lengths)
    return 1.0 - max(lengths) / total if total else 0.0


def spectrum_entropy(free: int, n_slots: int) -> float:
    """Of one fiber's free-slot mask: the entropy of its cut into free and held runs."""
    full = (1 << n_slots) - 1
    cuts = [length for _, length in runs(free)] + [length for _, length in runs(full & ~free)]
    return -sum(c / n_slots * math.log(c / n_slots) for c in cuts if 0 < c < n_slots)


@dataclass(frozen=True)
class Sample:
    """The network's state after ``request`` requests (time ``t``)."""

    request: int
    t: float
    utilization: float
    external_fragmentation: float
    entropy: float


def sample(grid: SpectrumGrid, request: int, t: float) -> Sample:
    n = grid.n_slots
    frag = [external_fragmentation(f) for f in grid.free]
    ent = [spectrum_entropy(f, n) for f in grid.free]
    return Sample(request, t, grid.utilization(), float(np.mean(frag)), float(np.mean(ent)))


def link_utilization(grid: SpectrumGrid) -> list[float]:
    """The share of each fiber's slots held."""
    n = grid.n_slots
    return [1.0 - f.bit_count() / n for f in grid.free]


def snapshot(grid: SpectrumGrid) -> np.ndarray:
    """Links x slots: the id of the lightpath holding each slot (guard bands included), -1 free."""
    return grid.owner
