"""The spectrum of every fiber: a grid of frequency slots, and lightpaths set up and released on it.

A lightpath takes the same contiguous run of slots on every link of its path (spectrum continuity
and contiguity). Free runs are found on the AND of the links' free masks with numpy, first-fit
(lowest index) or best-fit (the smallest free run that holds the request, which keeps large runs
for large requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Fit = Literal["first", "best"]


@dataclass(frozen=True)
class Lightpath:
    """A set-up lightpath: its links and slot range."""

    id: int
    links: tuple[int, ...]
    start: int
    slots: int


def _runs(free: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of every run of True in a 1-D bool array."""
    if not free.any():
        return []
    padded = np.concatenate(([False], free, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class SpectrumGrid:
    """Slot occupancy of ``n_links`` fibers of ``n_slots`` slots each."""

    def __init__(self, n_links: int, n_slots: int) -> None:
        if n_links <= 0 or n_slots <= 0:
            raise ValueError("a grid needs links and slots")
        self.n_links = n_links
        self.n_slots = n_slots
        self.owner = np.full((n_links, n_slots), -1, dtype=np.int64)  # lightpath id or -1
        self.paths: dict[int, Lightpath] = {}
        self._next_id = 0

    def free_mask(self, links: Sequence[int]) -> np.ndarray:
        """Slots free on every link of ``links``."""
        mask: np.ndarray = np.all(self.owner[list(links)] < 0, axis=0)
        return mask

    def find(self, links: Sequence[int], slots: int, fit: Fit = "first") -> int | None:
        """First slot of a free run of ``slots`` on every link, or None."""
        if slots <= 0 or slots > self.n_slots:
            return None
        runs = [(s, n) for s, n in _runs(self.free_mask(links)) if n >= slots]
        if not runs:
            return None
        if fit == "first":
            return runs[0][0]
        return min(runs, key=lambda r: (r[1], r[0]))[0]

    def allocate(self, links: Sequence[int], start: int, slots: int) -> Lightpath:
        """Set up a lightpath on ``[start, start + slots)``; ValueError if any slot is taken."""
        if start < 0 or slots <= 0 or start + slots > self.n_slots:
            raise ValueError(f"slot range {start}+{slots} outside 0..{self.n_slots}")
        idx = list(links)
        block = self.owner[idx, start : start + slots]
        if (block >= 0).any():
            raise ValueError("slot range not free on every link")
        lp = Lightpath(self._next_id, tuple(idx), start, slots)
        self._next_id += 1
        self.owner[idx, start : start + slots] = lp.id
        self.paths[lp.id] = lp
        return lp

    def setup(self, links: Sequence[int], slots: int, fit: Fit = "first") -> Lightpath | None:
        """Find and allocate in one step; None when blocked."""
        start = self.find(links, slots, fit)
        return None if start is None else self.allocate(links, start, slots)

    def release(self, lightpath_id: int) -> None:
        lp = self.paths.pop(lightpath_id)
        self.owner[list(lp.links), lp.start : lp.start + lp.slots] = -1

    def used_slots(self) -> int:
        return int((self.owner >= 0).sum())

    def utilization(self) -> float:
        """Fraction of all slots of all links in use."""
        return self.used_slots() / (self.n_links * self.n_slots)

    def check(self) -> None:
        """Assert the invariants: each lightpath owns exactly its contiguous range on each of its
        links, and nothing else is owned."""
        expected = np.full_like(self.owner, -1)
        for lp in self.paths.values():
            for link in lp.links:
                seg = expected[link, lp.start : lp.start + lp.slots]
                assert (seg < 0).all(), "two lightpaths share a slot"
                seg[:] = lp.id
        assert np.array_equal(expected, self.owner), "slot ownership out of step with lightpaths"
