"""Aggregation rules checked against numpy, scipy and a brute-force Krum, and the reason the
robust ones exist: one poisoned replica moves the mean far and them hardly at all."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from bytes_moved import BytesMoved
from scipy import stats

from dmsc.netmodel import leader_work
from dmsc.runtime.compute.aggregators import (
    AGGREGATORS,
    aggregate,
    describe,
    parse_aggregator,
    summed,
)


def _parts(count: int, n: int = 50, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(count)]


def _np(parts: list[torch.Tensor]) -> np.ndarray:
    return np.stack([p.numpy() for p in parts]).astype(np.float64)


def test_mean_and_weighted_mean_match_numpy() -> None:
    parts = _parts(4)
    np.testing.assert_allclose(aggregate("mean", parts).numpy(), _np(parts).mean(0), atol=1e-6)
    weights = [10.0, 0.0, 3.0, 7.0]
    expected = np.average(_np(parts), axis=0, weights=weights)
    got = aggregate("mean", parts, weights)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("count", [3, 4, 5, 6])
def test_median_matches_numpy_including_the_even_count_convention(count: int) -> None:
    parts = _parts(count, seed=count)
    expected = np.median(_np(parts), axis=0)
    np.testing.assert_allclose(aggregate("median", parts).numpy(), expected, atol=1e-6)


@pytest.mark.parametrize(("count", "trim"), [(5, 0.2), (6, 0.2), (7, 0.3), (10, 0.45), (4, 0.0)])
def test_trimmed_mean_matches_scipy(count: int, trim: float) -> None:
    parts = _parts(count, seed=count)
    expected = stats.trim_mean(_np(parts), trim, axis=0)
    got = aggregate("trimmed-mean", parts, trim=trim)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)


def _brute_krum_scores(vectors: np.ndarray, f: int) -> list[float]:
    """Every subset of n-f-2 others tried; the score is the smallest sum of squared distances."""
    count = len(vectors)
    scores = []
    for i in range(count):
        others = [j for j in range(count) if j != i]
        scores.append(
            min(
                sum(float(np.sum((vectors[i] - vectors[j]) ** 2)) for j in subset)
                for subset in itertools.combinations(others, count - f - 2)
            )
        )
    return scores


@pytest.mark.parametrize(("count", "f", "seed"), [(5, 1, 0), (7, 2, 1), (7, 1, 2), (8, 0, 3)])
def test_krum_and_multi_krum_match_brute_force(count: int, f: int, seed: int) -> None:
    parts = _parts(count, n=8, seed=seed)
    parts[seed % count] = parts[seed % count] * 5  # an outlier among them
    scores = _brute_krum_scores(_np(parts), f)
    ranked = sorted(range(count), key=lambda i: (scores[i], i))
    assert torch.equal(aggregate("krum", parts, byzantine=f), parts[ranked[0]])
    expected = _np(parts)[ranked[: count - f]].mean(0)
    got = aggregate("multi-krum", parts, byzantine=f)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)


def test_robust_rules_resist_one_poisoned_replica_the_mean_does_not() -> None:
    g = torch.Generator().manual_seed(11)
    truth = torch.randn(1000, generator=g)
    honest = [truth + 0.1 * torch.randn(1000, generator=g) for _ in range(5)]
    spread = max(float((h - truth).norm()) for h in honest)
    parts = [*honest, -100 * honest[0]]
    assert float((aggregate("mean", parts) - truth).norm()) > 10 * spread
    for name in ("median", "trimmed-mean", "krum", "multi-krum"):
        assert float((aggregate(name, parts) - truth).norm()) <= spread, name
    # Robust rules ignore weights: a poisoned replica claiming many samples changes nothing.
    heavy = aggregate("multi-krum", parts, [1, 1, 1, 1, 1, 1e9])
    assert torch.equal(heavy, aggregate("multi-krum", parts))


def test_counts_too_small_for_the_requested_tolerance_say_so() -> None:
    with pytest.raises(ValueError, match=r"n >= 2f\+3 = 5 replicas, got 4"):
        aggregate("krum", _parts(4))
    with pytest.raises(ValueError, match=r"n >= 2f\+3 = 7"):
        aggregate("multi-krum", _parts(6), byzantine=2)
    with pytest.raises(ValueError, match=r"n >= 2f\+1 = 3"):
        aggregate("median", _parts(2))
    with pytest.raises(ValueError, match="trims nothing"):
        aggregate("trimmed-mean", _parts(6), trim=0.1)
    assert aggregate("median", _parts(2), byzantine=0).shape == (50,)


def test_bad_inputs_are_refused_with_a_reason() -> None:
    parts = _parts(5)
    bad = [*parts[:3], torch.full((50,), float("nan")), parts[4]]
    for name in AGGREGATORS:
        with pytest.raises(ValueError, match="vector 3 has NaN"):
            aggregate(name, bad)
    with pytest.raises(ValueError, match="vector 2 is"):
        aggregate("mean", [parts[0], parts[1], torch.zeros(49)])
    with pytest.raises(ValueError, match="no vectors"):
        aggregate("median", [])
    with pytest.raises(ValueError, match="3 weights for 5"):
        aggregate("mean", parts, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="not all zero"):
        aggregate("mean", parts, [0.0] * 5)
    with pytest.raises(ValueError, match="expected mean, median"):
        aggregate("average", parts)
    with pytest.raises(ValueError, match="trim"):
        aggregate("trimmed-mean", parts, trim=0.5)


def test_parse_aggregator_reads_the_command_line_forms() -> None:
    assert parse_aggregator("mean") == ("mean", {})
    assert parse_aggregator("trimmed-mean:0.1") == ("trimmed-mean", {"trim": 0.1})
    assert parse_aggregator("krum:1") == ("krum", {"byzantine": 1})
    assert parse_aggregator(" multi-krum:2 ") == ("multi-krum", {"byzantine": 2})
    name, options = parse_aggregator("krum:0")
    assert aggregate(name, _parts(3), **options).shape == (50,)
    for text in ("median:1", "krum:-1", "krum:x", "trimmed-mean:0.5", "krum:", "avg", "mean:1"):
        with pytest.raises(ValueError, match="expected mean, median"):
            parse_aggregator(text)
    assert all(describe(name) for name in AGGREGATORS)
    with pytest.raises(ValueError, match="expected mean, median"):
        describe("avg")


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13, 16])
def test_the_sorting_network_ranks_as_torch_sort_and_leaves_the_inputs(count: int) -> None:
    """The median and the trimmed mean rank each coordinate's values by a sorting network
    (faster than ``torch.sort`` along the replicas, as the cost model prices it): the same rows
    as ``torch.sort``, ties included, and the caller's vectors unchanged."""
    from dmsc.runtime.compute.aggregators import _ranked

    g = torch.Generator().manual_seed(count)
    parts = [torch.randint(-3, 4, (200,), generator=g).float() for _ in range(count)]
    before = [p.clone() for p in parts]
    ranked = torch.stack(_ranked(parts))
    assert torch.equal(ranked, torch.stack(parts).sort(dim=0).values)
    assert all(torch.equal(a, b) for a, b in zip(parts, before, strict=True))
    doubles = [p.double() for p in parts]
    trimmed = aggregate("trimmed-mean", doubles, trim=0.0)
    assert all(torch.equal(a, b.double()) for a, b in zip(doubles, before, strict=True))
    np.testing.assert_allclose(trimmed.numpy(), _np(parts).mean(0), atol=1e-12)


@pytest.mark.parametrize("count", [1, 2, 3, 7, 16])
def test_summed_adds_in_turn_as_float64_would_within_rounding(count: int) -> None:
    """The leader's sum, one vector added at a time (as the cost model prices it): within fp32
    rounding of the float64 sum (``torch.stack(parts).sum(0)``, which it replaced, pairs rows
    for short vectors, so the two may differ in the last bits), exactly it for two vectors, and
    no input changed."""
    from dmsc.runtime.compute.aggregators import summed

    parts = _parts(count, n=10_000, seed=count)
    before = [p.clone() for p in parts]
    got = summed(parts)
    exact = _np(parts).sum(0)
    bound = (count - 1) * np.finfo(np.float32).eps * np.abs(_np(parts)).sum(0)
    assert np.all(np.abs(got.numpy() - exact) <= bound + 1e-12)
    if count <= 2:
        assert torch.equal(got, torch.stack(parts).sum(0))
    assert all(torch.equal(a, b) for a, b in zip(parts, before, strict=True))


@pytest.mark.parametrize("count", [3, 4, 5, 8])
def test_the_bytes_each_rule_moves_are_the_ones_the_cost_model_prices(count: int) -> None:
    """``dmsc.netmodel.leader_work`` prices the leader's rules by the bytes their torch
    operations read and write: counted here operation by operation (``tests/bytes_moved.py``)
    as the rules run, against its figure for every rule the count allows (the mean as the
    leader takes it: the replicas' sum over their count)."""
    elements = 1 << 16
    parts = _parts(count, n=elements, seed=count)
    forms = ["mean", "median", "krum:0", "multi-krum:0"]
    forms += [f"trimmed-mean:{0.25 if count < 8 else 0.2}"] if count >= 4 else []
    forms += ["krum:1", "multi-krum:1"] if count >= 5 else []
    for form in forms:
        name, options = parse_aggregator(form)
        with BytesMoved() as moved:
            if name == "mean":
                summed(parts) / count
            else:
                aggregate(name, parts, **options)
        # Krum's n x n distances, their sort and the scores are a few bytes, not an element's
        assert moved.per_element(elements) == pytest.approx(
            leader_work.bytes_per_element(form, count), abs=0.1
        ), (form, dict(moved.by_op))
