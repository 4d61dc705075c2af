"""Token sampling against a reference written the other way round: token by token, from the
definitions (rank among the logits for top-k, probability of the more likely tokens for top-p),
in plain Python floats."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.runtime.compute.executor import logits_reply
from dmsc.runtime.compute.sampling import draw, reply_logits, shipped_top, token_probs
from dmsc.runtime.transport.messages import InferRequest, Sampling


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> list[float]:
    n = len(logits)
    if temperature == 0:
        best = max(range(n), key=lambda i: logits[i])
        return [1.0 if i == best else 0.0 for i in range(n)]
    z = [x / temperature for x in logits]
    rank = [sum(1 for j in range(n) if z[j] > z[i]) for i in range(n)]  # distinct logits
    kept = [top_k == 0 or rank[i] < top_k for i in range(n)]
    m = max(z[i] for i in range(n) if kept[i])
    e = [math.exp(z[i] - m) if kept[i] else 0.0 for i in range(n)]
    total = sum(e)
    p = [x / total for x in e]
    if top_p < 1:
        ahead = [sum(p[j] for j in range(n) if p[j] > p[i]) for i in range(n)]
        p = [p[i] if ahead[i] < top_p else 0.0 for i in range(n)]
        total = sum(p)
        p = [x / total for x in p]
    return p


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=40, unique=True),
    temperature=st.sampled_from([0.0, 0.3, 0.8, 1.0, 2.5]),
    top_k=st.integers(0, 45),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-6]),
)
def test_probabilities_match_the_definitions(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> None:
    # distinct after scaling too (ties make "the k most likely" ambiguous)
    if len({round(x, 6) for x in logits}) < len(logits):
        return
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    got = token_probs(torch.tensor(logits, dtype=torch.float64), s).tolist()
    want = reference_probs(logits, temperature, top_k, top_p)
    assert got == pytest.approx(want, abs=1e-9)
    assert sum(got) == pytest.approx(1.0)


def test_greedy_and_top_k_1_draw_the_most_likely() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    g = torch.Generator().manual_seed(0)
    assert draw(logits, Sampling(temperature=0), g) == 1
    assert {draw(logits, Sampling(temperature=5, top_k=1), g) for _ in range(50)} == {1}


def test_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(1)
    s = Sampling(temperature=1.0, top_p=0.8)  # keeps 0.5 and 0.3 only
    counts = [0] * 4
    for _ in range(4000):
        counts[draw(logits, s, g)] += 1
    assert counts[2] == counts[3] == 0
    assert counts[0] / 4000 == pytest.approx(0.5 / 0.8, abs=0.03)


def test_requests_get_a_seed_they_can_repeat() -> None:
    first = InferRequest(prompt="x").sampling()
    assert first.seed is not None and 0 <= first.seed < 2**63
    assert InferRequest(prompt="x", seed=7, top_k=3).sampling() == Sampling(seed=7, top_k=3)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("seed", -1)],
)
def test_bad_settings_are_refused_by_name(field: str, value: float) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        InferRequest(prompt="x", **{field: value})


def test_the_last_stage_ships_what_the_draw_reads() -> None:
    """Greedy reads the most likely token, top-k the k most likely; anything else the whole
    vocabulary."""
    assert shipped_top(Sampling(temperature=0, top_k=50), 100) == 1
    assert shipped_top(Sampling(temperature=0.7, top_k=40, top_p=0.9), 100) == 40
    assert shipped_top(Sampling(temperature=0.7), 100) is None  # top_k 0: all of them
    assert shipped_top(Sampling(temperature=0.7, top_k=100), 100) is None


@pytest.mark.parametrize(
    "s",
    [
        Sampling(temperature=0),
        Sampling(temperature=0.8, top_k=1),
        Sampling(temperature=0.8, top_k=7),
        Sampling(temperature=1.5, top_k=20, top_p=0.5),
        Sampling(temperature=0.5),
    ],
)
def test_a_draw_from_the_shipped_logits_is_the_draw_from_all_of_them(s: Sampling) -> None:
    """The tokens drawn from what :func:`logits_reply` sends (its ``top``) equal, generator for
    generator, those drawn from the whole rows, as decoding drew them before ``top``."""
    vocab = 300
    for seed in range(20):
        rows = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 4
        reply = logits_reply(rows, shipped_top(s, vocab))
        shipped = reply_logits(reply, vocab)
        g_all, g_top = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = [draw(rows[0], s, g_all) for _ in range(5)]
        assert [draw(shipped[0], s, g_top) for _ in range(5)] == want
        if shipped_top(s, vocab) is None:
            assert torch.equal(shipped, rows)  # the whole rows, bit for bit
