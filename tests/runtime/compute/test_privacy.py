"""Clipping, noise and the privacy ledger, checked against numpy and closed-form privacy bounds."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from bytes_moved import BytesMoved
from scipy import optimize, stats

from dmsc.netmodel import leader_work
from dmsc.runtime.compute.privacy import PrivacyLedger, add_noise, clip_update

# Opacus' RDP orders (RDPAccountant.DEFAULT_ALPHAS), written out so the reference stays independent.
ALPHAS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=np.float64)


def test_clipping_matches_a_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    for scale in (0.01, 0.3, 1.0, 5.0, 100.0):
        x = rng.normal(0.0, scale, 1_000).astype(np.float32)
        clipped, norm = clip_update(torch.from_numpy(x), max_norm=10.0)
        reference_norm = float(np.linalg.norm(x.astype(np.float64)))
        reference = x.astype(np.float64) * min(1.0, 10.0 / reference_norm)
        assert norm == pytest.approx(reference_norm, rel=1e-12)
        np.testing.assert_allclose(clipped.numpy(), reference, rtol=1e-6, atol=1e-7)
        assert float(np.linalg.norm(clipped.numpy().astype(np.float64))) <= 10.0 * (1 + 1e-6)


def test_clipping_leaves_a_zero_or_short_vector_alone_and_never_aliases_it() -> None:
    zero = torch.zeros(5)
    clipped, norm = clip_update(zero, 1.0)
    assert norm == 0.0 and torch.equal(clipped, zero) and clipped is not zero
    short = torch.tensor([0.3, 0.4])
    assert torch.equal(clip_update(short, 1.0)[0], short)


def test_noise_has_the_promised_standard_deviation_and_is_reproducible() -> None:
    total = torch.full((1_000_000,), 3.0)
    noised = add_noise(total, 1.3, 0.5, torch.Generator().manual_seed(11))
    noise = (noised - total).double()
    assert float(noise.std()) == pytest.approx(1.3 * 0.5, rel=0.01)
    assert abs(float(noise.mean())) < 5 * 0.65 / 1_000  # five standard errors
    assert stats.kstest(noise.numpy()[:100_000] / 0.65, "norm").pvalue > 1e-3
    again = add_noise(total, 1.3, 0.5, torch.Generator().manual_seed(11))
    assert torch.equal(noised, again) and noised.dtype == total.dtype
    assert torch.equal(add_noise(total, 0.0, 0.5, torch.Generator()), total)


def test_the_bytes_clip_and_noise_move_are_the_ones_the_cost_model_prices() -> None:
    """``dmsc.netmodel.leader_work.privacy_work_s`` prices the clip and the noise by the bytes
    their torch operations read and write, counted here operation by operation
    (``tests/bytes_moved.py``), besides the draws, priced at the host's Gaussian rate (what
    ``dmsc calibrate`` times is ``torch.randn``, its 4 bytes an element written included)."""
    elements = 1 << 16
    x = torch.randn(elements, generator=torch.Generator().manual_seed(3))
    for max_norm in (1.0, 1e9):  # clipped, and short enough to be copied as it is
        with BytesMoved() as clip:
            clip_update(x, max_norm)
        # the norm and the sum read back are a few bytes, not an element's
        assert clip.per_element(elements) == pytest.approx(leader_work.CLIP, abs=0.01)
    with BytesMoved() as noise:
        add_noise(x, 1.1, 1.0, torch.Generator().manual_seed(4))
    draws = noise.by_op.pop("aten.randn.generator")
    assert draws == 4 * elements
    assert (noise.bytes - draws) / elements == pytest.approx(leader_work.NOISE_PASSES, abs=0.01)


def test_epsilon_falls_with_more_noise_and_grows_with_rounds() -> None:
    by_noise = [PrivacyLedger(z, 1.0, rounds=100).epsilon(1e-5) for z in (2.0, 5.0, 10.0, 20.0)]
    assert by_noise == sorted(by_noise, reverse=True) and len(set(by_noise)) == 4
    by_rounds = [PrivacyLedger(10.0, 1.0, rounds=t).epsilon(1e-5) for t in (1, 10, 100, 1000)]
    assert by_rounds == sorted(by_rounds) and len(set(by_rounds)) == 4
    assert PrivacyLedger(1.0, 1.0).epsilon(1e-5) == 0.0
    assert PrivacyLedger(0.0, 1.0, rounds=1).epsilon(1e-5) == math.inf


def test_epsilon_with_sampling_equals_opacus_analysis_called_directly() -> None:
    from opacus.accountants.analysis.rdp import (  # type: ignore[import-untyped]
        compute_rdp,
        get_privacy_spent,
    )

    ledger = PrivacyLedger(noise_multiplier=1.1, max_norm=1.0, sample_rate=0.01, rounds=10_000)
    rdp = compute_rdp(q=0.01, noise_multiplier=1.1, steps=10_000, orders=list(ALPHAS))
    reference, _ = get_privacy_spent(orders=list(ALPHAS), rdp=rdp, delta=1e-5)
    assert ledger.epsilon(1e-5) == pytest.approx(float(reference), rel=1e-12)


@pytest.mark.parametrize(("sigma", "rounds"), [(5.0, 50), (10.0, 100), (20.0, 1000)])
def test_epsilon_of_full_participation_matches_closed_forms(sigma: float, rounds: int) -> None:
    delta = 1e-5
    epsilon = PrivacyLedger(sigma, 1.0, rounds=rounds).epsilon(delta)
    # Gaussian RDP is alpha / (2 sigma^2) per round; converted to (eps, delta) by Balle et al.
    # (2020, Thm. 21), minimised over Opacus' orders.
    rdp = ALPHAS * rounds / (2 * sigma**2)
    by_order = rdp - (math.log(delta) + np.log(ALPHAS)) / (ALPHAS - 1) + np.log(1 - 1 / ALPHAS)
    assert epsilon == pytest.approx(float(by_order.min()), rel=1e-9)
    # RDP only bounds the exact curve of T Gaussian rounds, i.e. one Gaussian with
    # mu = sqrt(T) / sigma (Balle & Wang 2018, Thm. 8): never below it, and close above it.
    mu = math.sqrt(rounds) / sigma

    def exact_delta(eps: float) -> float:
        tail = math.exp(eps + stats.norm.logcdf(-mu / 2 - eps / mu))
        return float(stats.norm.cdf(mu / 2 - eps / mu)) - tail - delta

    exact = optimize.brentq(exact_delta, 0.0, 200.0)
    assert exact <= epsilon <= 1.15 * exact


def test_the_ledger_counts_rounds_and_publishes_its_record() -> None:
    ledger = PrivacyLedger(noise_multiplier=5.0, max_norm=0.5)
    ledger.record_round()
    ledger.record_round(49)
    record = ledger.as_json(1e-5)
    assert record == {
        "mechanism": "gaussian (site update clipping + noise, central DP)",
        "max_norm": 0.5,
        "noise_multiplier": 5.0,
        "sample_rate": 1.0,
        "rounds": 50,
        "delta": 1e-5,
        "epsilon": PrivacyLedger(5.0, 0.5, rounds=50).epsilon(1e-5),
        "accountant": "opacus RDP",
    }
    assert 0 < float(record["epsilon"]) < 10


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: clip_update(torch.ones(3), -1.0), "max_norm"),
        (lambda: clip_update(torch.ones(3), float("nan")), "max_norm"),
        (lambda: clip_update(torch.tensor([1.0, float("nan")]), 1.0), "NaN"),
        (lambda: clip_update(torch.ones(3, dtype=torch.int64), 1.0), "floating"),
        (lambda: add_noise(torch.ones(3), -0.1, 1.0, torch.Generator()), "noise_multiplier"),
        (lambda: add_noise(torch.tensor([float("inf")]), 1.0, 1.0, torch.Generator()), "NaN"),
        (lambda: PrivacyLedger(1.0, 0.0), "max_norm"),
        (lambda: PrivacyLedger(1.0, 1.0, sample_rate=0.0), "sample_rate"),
        (lambda: PrivacyLedger(1.0, 1.0, rounds=-1), "rounds"),
        (lambda: PrivacyLedger(1.0, 1.0).record_round(-2), "count"),
        (lambda: PrivacyLedger(1.0, 1.0, rounds=3).epsilon(0.0), "delta"),
        (lambda: PrivacyLedger(1.0, 1.0, rounds=3).epsilon(1.0), "delta"),
        (lambda: PrivacyLedger(1.0, 1.0, rounds=3).as_json(-1e-5), "delta"),
    ],
)
def test_nonsense_settings_are_refused(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
