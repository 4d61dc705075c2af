"""One host thread's rates of the exchange work the cost model prices per element."""

from __future__ import annotations

import torch

from dmsc.runtime.compute.compression import PowerSGD
from dmsc.runtime.compute.host_rates import (
    LOWRANK_COLS,
    LOWRANK_RANK,
    lowrank_products,
    measure_lowrank_seconds,
    threads,
)


def test_the_timed_products_are_the_codecs_own() -> None:
    """What ``dmsc calibrate`` times for ``lowrank_ns`` computes what the codec computes in one
    exchange of one replica (its averages its own factors): the same answer and error, from
    the same starting factor."""
    rows = 96
    x = torch.randn(rows * LOWRANK_COLS, generator=torch.Generator().manual_seed(3))
    codec = PowerSGD([torch.Size([rows, LOWRANK_COLS])], rank=LOWRANK_RANK, seed=5)
    qt = codec._qt[0].clone()  # the starting factor, Q^T
    answer = codec.finish(codec.middle(codec.start(x)))
    m = x.view(rows, LOWRANK_COLS)
    out, error = torch.empty_like(m), torch.empty_like(m)
    lowrank_products(m, qt, out, error)
    torch.testing.assert_close(out.reshape(-1), answer, rtol=0, atol=0)
    torch.testing.assert_close(error.reshape(-1), codec.residual, rtol=0, atol=0)


def test_a_rate_is_measured_on_one_thread_and_the_threads_restored() -> None:
    before = torch.get_num_threads()
    seconds = measure_lowrank_seconds(elements=64 * LOWRANK_COLS)
    assert 0 < seconds < 1e-6  # an element's products: nanoseconds
    assert torch.get_num_threads() == before
    with threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
