from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dmsc.runtime.control.serving.combiners import (
    METHODS,
    AttentionCombiner,
    combine,
    fit_attention,
    score,
    vote,
    weighted,
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # small tensors are all overhead: two threads on a shared 2-core machine ran the attention
    # fit 20x slower than one
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _random_probs(k: int, n: int, c: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(n, c, generator=g) * 2, -1) for _ in range(k)]


def _brute_vote(probs: list[torch.Tensor | None], weights: list[float] | None) -> list[int]:
    """The voted class of each sample by counting in Python loops."""
    present = [(k, p) for k, p in enumerate(probs) if p is not None]
    n, c = present[0][1].shape
    winners = []
    for i in range(n):
        counts = [0.0] * c
        summed = [0.0] * c
        for k, p in present:
            w = 1.0 if weights is None else weights[k]
            counts[int(p[i].argmax())] += w
            for j in range(c):
                summed[j] += w * float(p[i, j])
        best = max(counts)
        tied = [j for j in range(c) if counts[j] >= best * (1 - 1e-9)]
        winners.append(max(tied, key=lambda j: (summed[j], -j)))
    return winners


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_vote_matches_a_brute_force_count(k: int) -> None:
    # 3 classes and few heads: many ties, so the tie-break is exercised
    probs: list[torch.Tensor | None] = list(_random_probs(k, 300, 3, seed=k))
    out = vote(probs)
    assert out.argmax(-1).tolist() == _brute_vote(probs, None)
    torch.testing.assert_close(out.sum(-1), torch.ones(300))
    weights = [0.5 + 0.25 * i for i in range(k)]
    assert vote(probs, weights).argmax(-1).tolist() == _brute_vote(probs, weights)


def test_vote_is_the_mean_of_the_winners_and_breaks_ties_by_summed_probability() -> None:
    a = torch.tensor([[0.6, 0.3, 0.1]])
    b = torch.tensor([[0.2, 0.7, 0.1]])
    # one vote each for classes 0 and 1; summed probability 0.8 vs 1.0: class 1 wins
    out = vote([a, b])
    torch.testing.assert_close(out, b)
    c = torch.tensor([[0.5, 0.4, 0.1]])
    # two votes for class 0 beat one for class 1; the result averages the two winners
    torch.testing.assert_close(vote([a, b, c]), (a + c) / 2)
    # a weight of 3 on b outvotes a and c
    torch.testing.assert_close(vote([a, b, c], [1, 3, 1]), b)
    # all agree: the vote is the weighted average
    torch.testing.assert_close(vote([a, c], [1, 2]), weighted([a, c], [1, 2]))


def test_weighted_matches_numpy() -> None:
    probs = _random_probs(4, 50, 7, seed=1)
    weights = [0.3, 0.1, 0.4, 0.2]
    expected = np.einsum("k,knc->nc", np.array(weights) / sum(weights), np.stack(probs))
    np.testing.assert_allclose(weighted(probs, weights).numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(weighted(probs).numpy(), np.stack(probs).mean(0), rtol=1e-5)


def test_missing_heads_renormalise_over_the_rest() -> None:
    probs = _random_probs(3, 40, 5, seed=2)
    late: list[torch.Tensor | None] = [probs[0], None, probs[2]]
    weights = [2.0, 5.0, 1.0]
    torch.testing.assert_close(weighted(late, weights), weighted([probs[0], probs[2]], [2.0, 1.0]))
    torch.testing.assert_close(vote(late), vote([probs[0], probs[2]]))
    torch.testing.assert_close(weighted([None, probs[1], None]), probs[1])
    combiner = AttentionCombiner(3, seed=0)
    a = combiner.attention_weights(late)
    assert torch.all(a[:, 1] == 0)
    torch.testing.assert_close(a.sum(-1), torch.ones(40))


def test_refusals_name_the_reason() -> None:
    probs = _random_probs(2, 10, 4, seed=3)
    with pytest.raises(ValueError, match="all 3 heads are missing"):
        weighted([None, None, None])
    with pytest.raises(ValueError, match="all 2 heads are missing"):
        vote([None, None])
    with pytest.raises(ValueError, match="empty"):
        vote([])
    with pytest.raises(ValueError, match="head 1: shape"):
        weighted([probs[0], torch.rand(10, 5)])
    with pytest.raises(ValueError, match=r"must be \[N, C\]"):
        weighted([torch.rand(10)])
    with pytest.raises(ValueError, match="2 weights for 3 heads"):
        weighted([*probs, None], [1.0, 1.0])
    with pytest.raises(ValueError, match="non-negative"):
        weighted(probs, [1.0, -1.0])
    with pytest.raises(ValueError, match="sum to 0"):
        weighted([probs[0], None], [0.0, 1.0])
    with pytest.raises(ValueError, match="unknown aggregation method 'mean'"):
        combine("mean", probs)
    with pytest.raises(ValueError, match="needs a trained AttentionCombiner"):
        combine("attention", probs)
    with pytest.raises(ValueError, match="2 head outputs for a combiner of 3"):
        AttentionCombiner(3)(probs)


def _two_good_heads_and_noise(n: int, c: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, c, (n,), generator=g)
    hot = torch.nn.functional.one_hot(labels, c).float()
    good = [
        torch.softmax(torch.randn(n, c, generator=g) * 1.5 + 2.0 * hot, -1),
        torch.softmax(torch.randn(n, c, generator=g) * 1.5 + 1.5 * hot, -1),
    ]
    noise = torch.softmax(torch.randn(n, c, generator=g) * 4.0, -1)  # confident and random
    return [good[0], noise, good[1]], labels


def test_attention_learns_to_ignore_a_noisy_head() -> None:
    fit_probs, fit_labels = _two_good_heads_and_noise(4000, 10, seed=0)
    test_probs, test_labels = _two_good_heads_and_noise(4000, 10, seed=1)
    combiner = AttentionCombiner(3, seed=0)
    losses = fit_attention(combiner, fit_probs, fit_labels, steps=150, lr=0.05, seed=0, batch=1024)
    assert losses[-1] < losses[0]
    with torch.no_grad():
        attention = combine("attention", test_probs, combiner=combiner)
        noisy_weight = combiner.attention_weights(test_probs)[:, 1].mean().item()
    plain = score(weighted(test_probs), test_labels)
    learned = score(attention, test_labels)
    assert learned.accuracy > plain.accuracy + 0.02
    assert learned.loss < plain.loss
    assert noisy_weight < 0.1
    # still combines when the noisy head (or a good one) is late
    for late in range(3):
        part: list[torch.Tensor | None] = list(test_probs)
        part[late] = None
        assert combine("attention", part, combiner=combiner).shape == (4000, 10)


def test_fit_is_deterministic_with_a_seed() -> None:
    probs, labels = _two_good_heads_and_noise(500, 4, seed=2)
    runs = []
    for _ in range(2):
        combiner = AttentionCombiner(3, seed=5)
        runs.append(fit_attention(combiner, probs, labels, steps=20, seed=7, batch=128))
    assert runs[0] == runs[1]


def test_untrained_combiner_is_the_plain_average_and_every_method_dispatches() -> None:
    probs = _random_probs(3, 20, 6, seed=4)
    combiner = AttentionCombiner(3, seed=1)
    torch.testing.assert_close(combine("attention", probs, combiner=combiner), weighted(probs))
    for method in METHODS:
        out = combine(method, probs, weights=[1.0, 2.0, 3.0], combiner=combiner)
        torch.testing.assert_close(out.sum(-1), torch.ones(20))


def test_score() -> None:
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.0, 1.0]])
    s = score(probs, torch.tensor([0, 0, 1]))
    assert s.accuracy == pytest.approx(2 / 3)
    assert s.loss == pytest.approx(-(np.log(0.9) + np.log(0.2) + np.log(1.0)) / 3)
