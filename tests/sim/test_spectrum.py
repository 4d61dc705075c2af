from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from dmsc.sim.spectrum import FITS, SpectrumGrid, choose_start, runs, starts

LINKS, SLOTS = 5, 16


def test_first_fit_and_best_fit_by_hand() -> None:
    g = SpectrumGrid(2, 10)
    a = g.allocate([0], 0, 3)  # link 0: 0-2 taken
    g.allocate([1], 5, 2)  # link 1: 5-6 taken
    # Free on both: 3-4 (2 slots) and 7-9 (3 slots).
    assert g.find([0, 1], 2, "first") == 3
    assert g.find([0, 1], 3, "first") == 7
    assert g.find([0, 1], 4, "first") is None
    assert g.find([0, 1], 2, "best") == 3
    g.allocate([0], 3, 1)  # now free on both: 4 (1 slot) and 7-9
    assert g.find([0, 1], 1, "best") == 4
    assert g.find([0, 1], 1, "first") == 4
    g.release(a.id)
    assert g.find([0], 3, "first") == 0
    with pytest.raises(ValueError):
        g.allocate([0, 1], 5, 1)


class SpectrumMachine(RuleBasedStateMachine):
    """Random set-ups and releases keep continuity, contiguity and exclusivity."""

    paths = Bundle("paths")

    def __init__(self) -> None:
        super().__init__()
        self.grid = SpectrumGrid(LINKS, SLOTS)

    @rule(
        target=paths,
        links=st.lists(st.integers(0, LINKS - 1), min_size=1, max_size=3, unique=True),
        slots=st.integers(1, 6),
        fit=st.sampled_from(["first", "best"]),
    )
    def setup(self, links: list[int], slots: int, fit: str) -> int:
        before = self.grid.free_mask(links)
        lp = self.grid.setup(links, slots, fit)  # type: ignore[arg-type]
        if lp is None:
            # Blocked only when no free run is long enough on the AND of the links.
            runs = np.diff(np.flatnonzero(np.diff(np.concatenate(([0], before.astype(int), [0])))))
            assert all(r < slots for r in runs[::2])
            return -1
        assert all(before[lp.start : lp.start + lp.slots])
        return lp.id

    @rule(lp=consumes(paths))
    def release(self, lp: int) -> None:
        if lp >= 0:
            self.grid.release(lp)

    @invariant()
    def consistent(self) -> None:
        self.grid.check()
        assert self.grid.used_slots() == sum(
            p.slots * len(p.links) for p in self.grid.paths.values()
        )


TestSpectrum = SpectrumMachine.TestCase
TestSpectrum.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def _reference_starts(free: list[bool], n: int) -> list[int]:
    """Every slot where a free run of ``n`` starts, by brute force over a list of booleans."""
    return [s for s in range(len(free) - n + 1) if all(free[s : s + n])]


def _reference_runs(free: list[bool]) -> list[tuple[int, int]]:
    out, s = [], 0
    while s < len(free):
        if free[s]:
            e = s
            while e < len(free) and free[e]:
                e += 1
            out.append((s, e - s))
            s = e
        else:
            s += 1
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=130), st.integers(1, 12))
def test_every_fit_against_brute_force(free: list[bool], n: int) -> None:
    """The bit-mask search against a plain scan of the slots, for every fit."""
    mask = sum(1 << s for s, f in enumerate(free) if f)
    can = _reference_starts(free, n)
    assert [s for s in range(len(free)) if (starts(mask, n) >> s) & 1] == can
    assert list(runs(mask)) == _reference_runs(free)
    if not can:
        assert all(choose_start(mask, n, fit) is None for fit in FITS)
        return
    assert choose_start(mask, n, "first") == can[0]
    assert choose_start(mask, n, "last") == can[-1]
    fitting = [r for r in _reference_runs(free) if r[1] >= n]
    assert choose_start(mask, n, "best") == min(fitting, key=lambda r: (r[1], r[0]))[0]
    exact = [s for s, length in fitting if length == n]
    assert choose_start(mask, n, "exact") == (exact[0] if exact else can[0])
    rng = random.Random(0)
    draws = {choose_start(mask, n, "random", rng) for _ in range(40 * len(can))}
    assert draws == set(can)  # every feasible start, and nothing else


def test_a_guard_band_is_held_above_each_lightpath() -> None:
    g = SpectrumGrid(1, 10, guard=1)
    a = g.allocate([0], 0, 3)  # slots 0-2, guard 3
    assert a.held == 4 and g.used_slots() == 4
    assert g.find([0], 2) == 4  # not 3: that is the guard band
    b = g.setup([0], 5)  # 4-8, guard 9
    assert b is not None and b.start == 4
    assert g.find([0], 1) is None  # slot 9 is b's guard band
    with pytest.raises(ValueError):
        g.allocate([0], 9, 1)  # its guard band would fall off the band's edge
    g.release(a.id)
    assert g.find([0], 3) == 0 and g.find([0], 4) is None
    g.check()
