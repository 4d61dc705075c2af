"""One host thread's rates of the exchange work the cost model prices per element
(:mod:`dmsc.netmodel.sync`, :mod:`dmsc.netmodel.codec_work`, :mod:`dmsc.netmodel.leader_work`):
a Gaussian draw (central privacy's noise), a pair's secure-aggregation mask, and PowerSGD's
products. ``dmsc calibrate`` writes them into the device spec (``gaussian_ns``, ``mask_ns``,
``lowrank_ns``); each is measured on one thread, as a worker computes
(``WorkerConfig.threads``), and the process's thread count is restored after."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dmsc.netmodel.constants import LOWRANK_RANK  # the rank PowerSGD's products are measured at

LOWRANK_COLS = 1024  # the measured matrix's columns (a transformer weight's width)


def median_seconds(fn: Callable[[], Any], repeats: int = 30) -> float:
    """The median of ``repeats`` timings of ``fn`` (after three calls that warm it)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def best_rate(fn: Callable[[], Any], work: float, repeats: int = 30) -> float:
    """``work`` over the median time of ``fn``."""
    return work / median_seconds(fn, repeats)


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads meanwhile."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def measure_gaussian_seconds(elements: int = 1 << 20, n_threads: int = 1) -> float:
    """Seconds to draw one fp32 Gaussian with a generator (central differential privacy's
    noise, as the stage leader draws it: ``torch.randn``)."""
    gen = torch.Generator().manual_seed(0)
    with threads(n_threads):
        rate = best_rate(lambda: torch.randn(elements, generator=gen), float(elements), 10)
    return 1.0 / rate


def measure_mask_seconds(elements: int = 1 << 20, n_threads: int = 1) -> float:
    """Seconds to expand one element of a pair's secure-aggregation mask, as each replica does
    for every other (``secure_agg.keystream``: ChaCha20 through OpenSSL, widened to int64); the
    key is fixed, as the rate does not depend on it."""
    from dmsc.runtime.compute.secure_agg import keystream

    key = bytes(range(32))
    with threads(n_threads):
        rate = best_rate(lambda: keystream(key, elements), float(elements), 10)
    return 1.0 / rate


def lowrank_products(
    m: torch.Tensor, qt: torch.Tensor, out: torch.Tensor, error: torch.Tensor
) -> None:
    """PowerSGD's four products with one matrix ``m`` (rows x cols) and its factor ``qt``
    (r x cols), as :class:`dmsc.runtime.compute.powersgd.PowerSGD` runs them in one exchange
    (one replica, its own factors for the averages): ``P = M Q``, ``P_hat`` (QR),
    ``Q_i^T = P_hat^T M``, the answer ``P_hat Q_i^T`` into ``out`` and the error
    ``M - P_hat Q_i^T`` into ``error``."""
    p = torch.mm(qt, m.T).T
    p_hat = torch.linalg.qr(p).Q
    q_own_t = torch.mm(p_hat.T, m)
    torch.mm(p_hat, q_own_t, out=out)
    torch.addmm(m, p_hat, q_own_t, alpha=-1, out=error)


def measure_lowrank_seconds(elements: int = 1 << 22, n_threads: int = 1) -> float:
    """Seconds per element of a gradient matrix for PowerSGD's products at rank
    :data:`LOWRANK_RANK` (:func:`lowrank_products`, on a matrix of :data:`LOWRANK_COLS`
    columns, past the caches as a model's gradients are)."""
    rows = max(1, elements // LOWRANK_COLS)
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(rows, LOWRANK_COLS, generator=gen)
    qt = torch.randn(LOWRANK_RANK, LOWRANK_COLS, generator=gen)
    out, error = torch.empty_like(m), torch.empty_like(m)
    with threads(n_threads):
        rate = best_rate(lambda: lowrank_products(m, qt, out, error), float(m.numel()), 10)
    return 1.0 / rate
