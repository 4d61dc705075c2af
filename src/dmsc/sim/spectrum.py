"""The spectrum of every fiber: a grid of frequency slots, and lightpaths set up and released on it.

A lightpath takes the same contiguous run of slots on every link of its path (spectrum continuity
and contiguity). Each link's free slots are one Python integer used as a bit mask (bit ``s`` set:
slot ``s`` free), so that a path's common free slots are the AND of its links' masks and the slots
where a free run of ``n`` starts are that AND shifted onto itself (log2 n steps): finding a place
for a request costs a few big-integer operations, not a pass over arrays. (numpy's boolean arrays
were the first version: per request, the AND, the run search and the ownership updates came to
tens of microseconds, most of it call overhead on 100-slot rows.)

Spectrum assignment policies (``Fit``), over the runs of free slots that can hold the request:

- ``first``: the lowest slot; ``last``: the highest (first and last fit);
- ``best``: the shortest free run that holds it (ties: lowest), keeping long runs for long requests;
- ``exact``: a free run exactly as long as the request if there is one, else first fit;
- ``random``: a start drawn uniformly among every feasible start slot.

A guard band of ``guard`` slots (flex-grid lightpaths need one between neighbours; one 12.5 GHz
slot in DeepRMSA's setting) is taken above every lightpath's own slots: a lightpath of ``n``
slots holds ``n + guard``.
"""

from __future__ import annotations

import random as _random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Fit = Literal["first", "best", "last", "random", "exact"]
FITS: tuple[str, ...] = ("first", "best", "last", "random", "exact")


@dataclass(frozen=True)
class Lightpath:
    """A set-up lightpath: its links and slot range."""

    id: int
    links: tuple[int, ...]
    start: int
    slots: int
    guard: int = 0  # guard-band slots held above the lightpath's own

    @property
    def held(self) -> int:
        return self.slots + self.guard


def starts(mask: int, n: int) -> int:
    """The bits ``s`` of ``mask`` where slots ``s .. s+n-1`` are all set (runs of ``n``)."""
    k = 1
    while k < n and mask:
        step = min(k, n - k)
        mask &= mask >> step
        k += step
    return mask


def runs(mask: int) -> Iterator[tuple[int, int]]:
    """(start, length) of every run of set bits of ``mask``, lowest first."""
    while mask:
        start = (mask & -mask).bit_length() - 1
        t = mask >> start
        length = (~t & (t + 1)).bit_length() - 1  # trailing ones of t
        yield start, length
        mask &= ~(((1 << length) - 1) << start)


def choose_start(mask: int, n: int, fit: str, rng: _random.Random | None = None) -> int | None:
    """Where a request of ``n`` slots goes on common free slots ``mask`` under ``fit``."""
    can = starts(mask, n)
    if not can:
        return None
    if fit == "first":
        return (can & -can).bit_length() - 1
    if fit == "last":
        return can.bit_length() - 1
    if fit == "random":
        pick = (rng or _random).randrange(can.bit_count())
        for _ in range(pick):
            can &= can - 1  # drop the lowest
        return (can & -can).bit_length() - 1
    fitting = [(s, length) for s, length in runs(mask) if length >= n]
    if fit == "exact":
        exact = [s for s, length in fitting if length == n]
        return exact[0] if exact else fitting[0][0]
    if fit == "best":
        return min(fitting, key=lambda r: (r[1], r[0]))[0]
    raise ValueError(f"unknown fit {fit!r} (fits: {', '.join(FITS)})")


class SpectrumGrid:
    """Slot occupancy of ``n_links`` fibers of ``n_slots`` slots each."""

    def __init__(self, n_links: int, n_slots: int, seed: int = 0, guard: int = 0) -> None:
        if n_links <= 0 or n_slots <= 0:
            raise ValueError("a grid needs links and slots")
        if guard < 0:
            raise ValueError("a guard band is 0 or more slots")
        self.n_links = n_links
        self.n_slots = n_slots
        self.guard = guard
        self.full = (1 << n_slots) - 1
        self.free = [self.full] * n_links  # per link: bit s set when slot s is free
        self.paths: dict[int, Lightpath] = {}
        self.rng = _random.Random(seed)  # random fit's draws
        self._next_id = 0
        self._used = 0

    def common_free(self, links: Sequence[int]) -> int:
        """The slots free on every link of ``links``, as a bit mask."""
        mask = self.full
        for link in links:
            mask &= self.free[link]
        return mask

    def free_mask(self, links: Sequence[int]) -> np.ndarray:
        """Slots free on every link of ``links``, as a bool array."""
        mask = self.common_free(links)
        return np.array([(mask >> s) & 1 for s in range(self.n_slots)], dtype=bool)

    @property
    def owner(self) -> np.ndarray:
        """Which lightpath owns each slot of each link (-1: free), built from the lightpaths."""
        out = np.full((self.n_links, self.n_slots), -1, dtype=np.int64)
        for lp in self.paths.values():
            out[list(lp.links), lp.start : lp.start + lp.held] = lp.id
        return out

    def find(self, links: Sequence[int], slots: int, fit: Fit = "first") -> int | None:
        """First slot of a free run of ``slots`` (and the guard band) on every link under
        ``fit``, or None."""
        if slots <= 0 or slots + self.guard > self.n_slots:
            return None
        return choose_start(self.common_free(links), slots + self.guard, fit, self.rng)

    def allocate(self, links: Sequence[int], start: int, slots: int) -> Lightpath:
        """Set up a lightpath on ``[start, start + slots)`` (and its guard band above); ValueError
        if any slot is taken."""
        held = slots + self.guard
        if start < 0 or slots <= 0 or start + held > self.n_slots:
            raise ValueError(f"slot range {start}+{held} outside 0..{self.n_slots}")
        want = ((1 << held) - 1) << start
        idx = tuple(links)
        if any(self.free[link] & want != want for link in idx):
            raise ValueError("slot range not free on every link")
        for link in idx:
            self.free[link] &= ~want
        lp = Lightpath(self._next_id, idx, start, slots, self.guard)
        self._next_id += 1
        self.paths[lp.id] = lp
        self._used += held * len(idx)
        return lp

    def setup(self, links: Sequence[int], slots: int, fit: Fit = "first") -> Lightpath | None:
        """Find and allocate in one step; None when blocked."""
        start = self.find(links, slots, fit)
        return None if start is None else self.allocate(links, start, slots)

    def release(self, lightpath_id: int) -> None:
        lp = self.paths.pop(lightpath_id)
        want = ((1 << lp.held) - 1) << lp.start
        for link in lp.links:
            self.free[link] |= want
        self._used -= lp.held * len(lp.links)

    def used_slots(self) -> int:
        return self._used

    def utilization(self) -> float:
        """Fraction of all slots of all links in use."""
        return self._used / (self.n_links * self.n_slots)

    def check(self) -> None:
        """Assert the invariants: each lightpath owns exactly its contiguous range on each of its
        links, no two share a slot, and the free masks are the complement of what they own."""
        expected = np.full((self.n_links, self.n_slots), -1, dtype=np.int64)
        for lp in self.paths.values():
            for link in lp.links:
                seg = expected[link, lp.start : lp.start + lp.held]
                assert (seg < 0).all(), "two lightpaths share a slot"
                seg[:] = lp.id
        for link in range(self.n_links):
            free = sum(1 << s for s in range(self.n_slots) if expected[link, s] < 0)
            assert free == self.free[link], "free slots out of step with the lightpaths"
        assert self._used == int((expected >= 0).sum()), "slot count out of step"
