"""The narrowed top-k selection against numpy's full sort: the same magnitudes kept, on long
vectors (the sampled threshold's path), with ties, zeros, a tail the sample misjudges and a
sample that sees only large values (the fallback)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dmsc.runtime.compute import top_select
from dmsc.runtime.compute.top_select import narrowed, top_indices


def _reference_values(a: torch.Tensor, k: int) -> np.ndarray:
    """The k largest magnitudes, in descending order, by numpy's full sort."""
    return np.sort(a.numpy())[::-1][:k]


def _check(a: torch.Tensor, k: int) -> torch.Tensor:
    idx = top_indices(a, k)
    assert idx.dtype == torch.int64 and idx.numel() == k
    assert bool((idx[1:] > idx[:-1]).all())  # k distinct entries, ascending (the codec's order)
    got = np.sort(a[idx].numpy())[::-1]
    np.testing.assert_array_equal(got, _reference_values(a, k))
    return idx


@pytest.mark.parametrize("fraction", [0.05, 0.01, 0.001, 1e-5])
@pytest.mark.parametrize("law", ["normal", "laplace", "lognormal"])
def test_the_narrowed_path_keeps_the_largest_magnitudes(fraction: float, law: str) -> None:
    n = 1 << 19
    g = np.random.default_rng(7)
    draw = {"normal": g.standard_normal, "laplace": g.laplace, "lognormal": g.lognormal}[law]
    a = torch.from_numpy(np.abs(draw(size=n)).astype(np.float32))
    k = math.ceil(fraction * n)
    assert narrowed(n, k)
    idx = _check(a, k)
    # with no ties at the k-th value the indices are torch.topk's own
    assert torch.equal(idx.sort().values, torch.topk(a, k).indices.sort().values)


def test_ties_zeros_and_a_constant_vector() -> None:
    n = 1 << 18
    a = torch.zeros(n)
    a[::7] = 1.0  # 37,450 ones tied, the rest zeros
    for k in (100, 20_000, 26_214):
        idx = _check(a, k)
        assert (a[idx] == 1.0).all()
        assert torch.equal(idx, torch.arange(0, 7 * k, 7))  # of the tied, the first ones
    _check(torch.zeros(n), 1000)  # every entry tied at zero
    _check(torch.full((n,), 3.0), 5000)


def test_a_tail_the_sample_misjudges_is_found_again() -> None:
    """Every entry the sample sees is large, the entries it skips tiny, and k more than it saw:
    each threshold lets too few through, and the selection falls back to torch.topk."""
    n = 1 << 20
    step = n // top_select.SAMPLE
    a = torch.full((n,), 1e-3)
    a[::step] = 5.0
    a[1::step] = torch.linspace(1.0, 2.0, n // step)  # the next largest, never sampled
    _check(a, 2 * top_select.SAMPLE)
    # a few large values hidden between the sampled positions: the candidates hold them
    b = torch.rand(n, generator=torch.Generator().manual_seed(3))
    b[3::step][:50] = 10.0
    idx = _check(b, 500)
    assert (b[idx] == 10.0).sum() == 50


def test_short_vectors_and_large_fractions_go_to_torch_topk() -> None:
    assert not narrowed(1000, 10)
    assert not narrowed(1 << 20, (1 << 20) // 2)
    assert narrowed(1 << 20, 1000)
    _check(torch.rand(1000), 10)
    _check(torch.rand(1 << 18), (1 << 18) // 2)
    assert top_indices(torch.rand(10), 0).numel() == 0
    # off the CPU, torch.topk as it is (here the meta device: shapes only, no values to read)
    assert top_indices(torch.empty(1 << 20, device="meta"), 1000).shape == (1000,)
    assert not narrowed(1 << 20, 1000, "meta")
    with pytest.raises(ValueError, match="outside"):
        top_indices(torch.rand(10), 11)
