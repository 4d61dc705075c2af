"""Combining the outputs of a business-segmented model's task heads at inference.

A model cut with ``dmsc segment --method business`` runs one backbone and several task heads,
each a micro-model of its own, possibly in another datacenter. When the heads answer the same
question (the same label space: here, the next byte), the control layer combines their class
probabilities for the same inputs into one answer. Three rules, as the architecture's seed names
them (002_0021f8a50f21532c.txt, "Model segmentation aggregation"):

- :func:`vote`: majority vote of the heads' most likely class, optionally weighted;
- :func:`weighted`: a weighted average of the probabilities (weights such as each head's
  validation accuracy or 1/loss);
- :class:`AttentionCombiner`: a small learned rule that scores every head per sample from its
  own output and a learned head embedding, and averages by the softmax of those scores
  (:func:`fit_attention` trains it on held-out data).

Every head's output is a ``[N, C]`` tensor of probabilities, or ``None`` for a head whose result
is late or missing (a timeout, a failed replica). Every rule combines the heads present and
renormalises their weights over them, so a late head costs accuracy, never the answer; only when
every head is missing is there nothing to combine (ValueError, with the reason). The attention
scores of a head depend on its own output alone, so dropping a head renormalises the others
exactly as the fixed weights are renormalised.

Pure functions of tensors: no clock, no I/O. Waiting for the heads (deadlines, retries) is the
caller's job; this module only decides what to do with what arrived.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

METHODS = ("vote", "weighted", "attention")

HeadProbs = Sequence[torch.Tensor | None]
"""One ``[N, C]`` probability tensor per head, ``None`` where the head's result did not come."""

_TIE_TOLERANCE = 1e-9  # relative: weighted vote counts this close to the top count are a tie
_FEATURES = 3  # per head and sample: normalised entropy, top probability, top-1 minus top-2


class Score(NamedTuple):
    """Accuracy and mean cross-entropy (nats) of probabilities against labels."""

    accuracy: float
    loss: float


def score(probs_NC: torch.Tensor, labels_N: torch.Tensor) -> Score:
    """How well ``probs_NC`` predicts ``labels_N``: accuracy of the argmax and the mean negative
    log-likelihood (probabilities floored at 1e-12 so that a vote's zeros stay finite)."""
    picked = probs_NC.gather(1, labels_N.reshape(-1, 1)).squeeze(1)
    accuracy = (probs_NC.argmax(-1) == labels_N).double().mean().item()
    loss = -picked.double().clamp_min(1e-12).log().mean().item()
    return Score(accuracy, loss)


def _present(probs: HeadProbs) -> tuple[list[int], torch.Tensor]:
    """Indices of the heads that answered and their outputs stacked ``[K', N, C]``."""
    if len(probs) == 0:
        raise ValueError("no heads to combine: the list of head outputs is empty")
    index = [k for k, p in enumerate(probs) if p is not None]
    present = [p for p in probs if p is not None]
    if not present:
        raise ValueError(f"nothing to combine: all {len(probs)} heads are missing (late or failed)")
    first = present[0]
    if first.dim() != 2:
        raise ValueError(
            f"head {index[0]}: probabilities must be [N, C], got shape {tuple(first.shape)}"
        )
    for k, p in zip(index[1:], present[1:], strict=True):
        if p.shape != first.shape:
            raise ValueError(
                f"head {k}: shape {tuple(p.shape)} differs from head {index[0]}'s "
                f"{tuple(first.shape)}; heads must answer the same N inputs over the same C classes"
            )
    return index, torch.stack(present)


def _weights(weights: Sequence[float] | None, heads: int, index: list[int]) -> torch.Tensor:
    """The present heads' weights as float64 ``[K']`` (ones without weights), unnormalised."""
    if weights is None:
        return torch.ones(len(index), dtype=torch.float64)
    if len(weights) != heads:
        raise ValueError(f"{len(weights)} weights for {heads} heads: give one weight per head")
    for k, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"head {k}: weight {w} must be finite and non-negative")
    w_present = torch.tensor([float(weights[k]) for k in index], dtype=torch.float64)
    if w_present.sum().item() <= 0:
        raise ValueError(f"the weights of the heads present ({index}) sum to 0: nothing to weigh")
    return w_present


def vote(probs: HeadProbs, weights: Sequence[float] | None = None) -> torch.Tensor:
    """Majority vote of the present heads' most likely class, as a ``[N, C]`` distribution.

    Each head votes for its argmax with its weight (1 without ``weights``). The class with the
    most votes wins; a tie between classes is broken by the (weighted) sum of the heads'
    probabilities for the tied classes, and an exact tie after that by the lowest class id.

    The result is the weighted mean of the probabilities of the heads that voted for the winner.
    Its argmax is the winning class (every one of those heads ranks the winner first, so their
    mean does too), and it is a proper distribution, so a vote has a finite loss; when all heads
    agree it equals :func:`weighted`. ``vote(...).argmax(-1)`` gives the voted class ids.
    """
    index, P_KNC = _present(probs)
    w_K = _weights(weights, len(probs), index)
    top_KN = P_KNC.argmax(-1)
    K, N, C = P_KNC.shape
    counts_NC = torch.zeros(N, C, dtype=torch.float64)
    counts_NC.scatter_add_(1, top_KN.T, w_K.expand(N, K).contiguous())
    best_N1 = counts_NC.amax(-1, keepdim=True)
    tied_NC = counts_NC >= best_N1 * (1 - _TIE_TOLERANCE)
    summed_NC = (w_K.to(P_KNC.dtype)[:, None, None] * P_KNC).sum(0)
    winner_N = torch.where(tied_NC, summed_NC, float("-inf")).argmax(-1)
    voters_KN = (top_KN == winner_N[None]).to(torch.float64) * w_K[:, None]
    voters_KN = voters_KN / voters_KN.sum(0, keepdim=True)
    return (voters_KN.to(P_KNC.dtype)[..., None] * P_KNC).sum(0)


def weighted(probs: HeadProbs, weights: Sequence[float] | None = None) -> torch.Tensor:
    """Weighted average ``[N, C]`` of the present heads' probabilities, the weights renormalised
    over the heads present (equal weights without ``weights``)."""
    index, P_KNC = _present(probs)
    w_K = _weights(weights, len(probs), index)
    w_K = (w_K / w_K.sum()).to(P_KNC.dtype)
    return (w_K[:, None, None] * P_KNC).sum(0)


def _head_features(P_KNC: torch.Tensor) -> torch.Tensor:
    """``[K, N, 3]``: each head's normalised entropy, top probability and top-1 minus top-2
    margin per sample: how sure the head is, read from its own output only."""
    C = P_KNC.shape[-1]
    entropy = -(P_KNC * P_KNC.clamp_min(1e-12).log()).sum(-1) / math.log(max(C, 2))
    top2 = P_KNC.topk(min(2, C), dim=-1).values
    margin = top2[..., 0] - (top2[..., 1] if C > 1 else 0)
    return torch.stack([entropy, top2[..., 0], margin], dim=-1)


class AttentionCombiner(nn.Module):
    """A learned combiner: per sample, softmax attention over the present heads.

    Head ``k``'s score for sample ``n`` is ``q . tanh(A f_kn + e_k)``, where ``f_kn`` are
    features of the head's own output (normalised entropy, top probability, margin), ``e_k`` is a
    learned embedding of the head (how good the head is in general) and ``q`` a learned query.
    The output is the softmax-weighted sum of the heads' probabilities, so it stays a
    distribution. ``q`` starts at zero: an untrained combiner is the plain average.
    """

    def __init__(self, heads: int, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"an attention combiner needs at least one head, got {heads}")
        g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.features = nn.Linear(_FEATURES, dim)
        with torch.no_grad():
            self.features.weight.copy_(torch.randn(dim, _FEATURES, generator=g) * 0.5)
            self.features.bias.zero_()
        self.head_embedding = nn.Parameter(torch.randn(heads, dim, generator=g) * 0.1)
        self.query = nn.Parameter(torch.zeros(dim))

    def _check(self, probs: HeadProbs) -> tuple[list[int], torch.Tensor]:
        if len(probs) != self.heads:
            raise ValueError(f"{len(probs)} head outputs for a combiner of {self.heads} heads")
        return _present(probs)

    def _attend(self, index: list[int], F_KNF: torch.Tensor) -> torch.Tensor:
        """``[K', N]``: the softmax over the present heads ``index`` of their scores."""
        h_KND = torch.tanh(self.features(F_KNF) + self.head_embedding[index, None])
        return torch.softmax(h_KND @ self.query, dim=0)

    def attention_weights(self, probs: HeadProbs) -> torch.Tensor:
        """``[N, K]``: each head's weight per sample; 0 for a missing head, the present heads'
        weights summing to 1."""
        index, P_KNC = self._check(probs)
        a_KN = self._attend(index, _head_features(P_KNC))
        out_NK = torch.zeros(P_KNC.shape[1], self.heads, dtype=a_KN.dtype)
        out_NK[:, index] = a_KN.T
        return out_NK

    def forward(self, probs: HeadProbs) -> torch.Tensor:
        """``[N, C]``: the heads' probabilities averaged by :meth:`attention_weights`."""
        index, P_KNC = self._check(probs)
        a_KN = self._attend(index, _head_features(P_KNC))
        return (a_KN[..., None] * P_KNC).sum(0)


def fit_attention(
    combiner: AttentionCombiner,
    head_probs: HeadProbs,
    labels: torch.Tensor,
    steps: int = 300,
    lr: float = 0.05,
    seed: int = 0,
    batch: int = 4096,
) -> list[float]:
    """Train ``combiner`` with cross-entropy on held-out ``head_probs`` (``[N, C]`` each, not
    data the heads trained on) and ``labels`` ``[N]``: Adam, ``steps`` mini-batches of
    ``batch`` samples drawn with ``seed`` (the same seed, the same combiner). Returns the loss of
    each step."""
    index, P_KNC = combiner._check(head_probs)
    labels_N = labels.reshape(-1)
    if labels_N.shape[0] != P_KNC.shape[1]:
        raise ValueError(f"{labels_N.shape[0]} labels for {P_KNC.shape[1]} samples")
    P_KNC = P_KNC.detach()
    F_KNF = _head_features(P_KNC)  # the features read no parameter: computed once
    N = P_KNC.shape[1]
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(combiner.parameters(), lr=lr)
    losses = []
    with torch.enable_grad():
        for _ in range(steps):
            pick = torch.randint(0, N, (batch,), generator=g) if batch < N else None
            P = P_KNC if pick is None else P_KNC[:, pick]
            feats = F_KNF if pick is None else F_KNF[:, pick]
            y = labels_N if pick is None else labels_N[pick]
            mixed = (combiner._attend(index, feats)[..., None] * P).sum(0)
            loss = F.nll_loss(mixed.clamp_min(1e-12).log(), y)
            optimizer.zero_grad()
            torch.autograd.backward(loss)
            optimizer.step()
            losses.append(loss.item())
    return losses


def combine(
    method: str,
    probs: HeadProbs,
    weights: Sequence[float] | None = None,
    combiner: AttentionCombiner | None = None,
) -> torch.Tensor:
    """The heads' outputs combined by ``method`` (one of :data:`METHODS`): ``weights`` for
    ``vote`` and ``weighted``, a trained ``combiner`` for ``attention``."""
    if method == "vote":
        return vote(probs, weights)
    if method == "weighted":
        return weighted(probs, weights)
    if method == "attention":
        if combiner is None:
            raise ValueError("method 'attention' needs a trained AttentionCombiner (combiner=)")
        with torch.no_grad():
            mixed: torch.Tensor = combiner(probs)
        return mixed
    raise ValueError(f"unknown aggregation method {method!r}: one of {', '.join(METHODS)}")
