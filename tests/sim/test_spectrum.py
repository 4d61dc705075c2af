from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from dmsc.sim.spectrum import SpectrumGrid

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
