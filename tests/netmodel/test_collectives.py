from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmsc.netmodel import (
    COLLECTIVES,
    all_reduce_lower_bound,
    p2p_time,
    ring_time,
    tree_all_reduce_time,
)
from dmsc.netmodel.collectives import bytes_sent_per_rank


def test_closed_forms_by_hand() -> None:
    # 4 ranks, 1 GB, 100 GB/s, 10 us per step.
    n, m, bw, a = 4, 1e9, 100e9, 10e-6
    assert ring_time("all_reduce", n, m, bw, a) == pytest.approx(6 * a + 1.5 * m / bw)
    assert ring_time("all_gather", n, m, bw, a) == pytest.approx(3 * a + 0.75 * m / bw)
    assert ring_time("reduce_scatter", n, m, bw, a) == pytest.approx(3 * a + 0.75 * m / bw)
    assert ring_time("all_to_all", n, m, bw, a) == pytest.approx(3 * a + 0.75 * m / bw)
    assert ring_time("broadcast", n, m, bw, a) == pytest.approx(3 * a + m / bw)
    assert ring_time("reduce", n, m, bw, a) == pytest.approx(3 * a + m / bw)
    assert ring_time("scatter", n, m, bw, a) == pytest.approx(3 * a + 0.75 * m / bw)
    assert p2p_time(m, bw, a) == pytest.approx(a + m / bw)
    assert tree_all_reduce_time(n, m, bw, a) == pytest.approx(4 * a + 2 * m / bw)
    # All-reduce is reduce-scatter followed by all-gather.
    assert ring_time("all_reduce", n, m, bw, a) == pytest.approx(
        ring_time("reduce_scatter", n, m, bw, a) + ring_time("all_gather", n, m, bw, a)
    )


def test_single_rank_and_empty_buffer_cost_nothing() -> None:
    for kind in COLLECTIVES:
        assert ring_time(kind, 1, 1e9, 1e9, 1e-6) == 0.0
        assert ring_time(kind, 8, 0, 1e9, 1e-6) == 0.0


def test_tree_wins_small_ring_wins_large() -> None:
    n, bw, a = 64, 25e9, 5e-6
    assert tree_all_reduce_time(n, 1e3, bw, a) < ring_time("all_reduce", n, 1e3, bw, a)
    assert ring_time("all_reduce", n, 1e9, bw, a) < tree_all_reduce_time(n, 1e9, bw, a)


def test_bad_arguments_rejected() -> None:
    with pytest.raises(ValueError):
        ring_time("all_reduce", 4, 1e6, 0.0, 1e-6)
    with pytest.raises(ValueError):
        ring_time("all_reduce", 0, 1e6, 1e9, 1e-6)


sizes = st.floats(min_value=1.0, max_value=1e12)
bws = st.floats(min_value=1e6, max_value=1e13)
ranks = st.integers(min_value=2, max_value=4096)
alphas = st.floats(min_value=0.0, max_value=1e-3)


@given(st.sampled_from(COLLECTIVES), ranks, sizes, bws, alphas, st.floats(1.0, 100.0))
def test_more_bandwidth_never_slower(
    kind: str, n: int, m: float, bw: float, a: float, factor: float
) -> None:
    assert ring_time(kind, n, m, bw * factor, a) <= ring_time(kind, n, m, bw, a)  # type: ignore[arg-type]


@given(ranks, sizes, bws, alphas)
def test_no_all_reduce_beats_bandwidth_bound(n: int, m: float, bw: float, a: float) -> None:
    bound = all_reduce_lower_bound(n, m, bw)
    assert ring_time("all_reduce", n, m, bw, a) >= bound * (1 - 1e-12)
    assert tree_all_reduce_time(n, m, bw, a) >= bound * (1 - 1e-12)


@given(st.sampled_from(COLLECTIVES), ranks, sizes)
def test_bytes_sent_are_bounded(kind: str, n: int, m: float) -> None:
    sent = bytes_sent_per_rank(kind, n, m)  # type: ignore[arg-type]
    assert 0 <= sent <= 2 * m
    assert math.isfinite(sent)
