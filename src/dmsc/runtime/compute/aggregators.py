"""Rules the stage leader combines its replicas' decoded vectors with, the mean and robust ones.

The mean is what data parallelism needs when every replica is honest; one replica that sends
garbage (a bug, a flipped bit, an attacker) moves it without bound. The robust rules bound that
influence, at the price of ignoring part of the honest signal:

- ``median``: coordinate-wise median; tolerates ``f`` bad replicas of ``n >= 2f + 1``. For an
  even count it is the mean of the two middle values (numpy's convention; torch.median would
  return the lower one, which biases the result downwards).
- ``trimmed-mean``: per coordinate, drop the ``floor(trim * n)`` largest and smallest values and
  average the rest (scipy.stats.trim_mean's convention); tolerates that many bad replicas.
- ``krum`` (Blanchard et al. 2017): the one vector whose ``n - f - 2`` nearest others are the
  closest (sum of squared distances); needs ``n >= 2f + 3``.
- ``multi-krum``: the mean of the ``n - f`` vectors of best Krum score.

Weights (the samples each replica trained on) are read by ``mean`` only: the robust rules give
every replica one vote, since a bad replica could claim any weight. ``byzantine`` (f) is read by
``median``, ``krum`` and ``multi-krum``; ``trimmed-mean`` tolerates ``floor(trim * n)`` instead.
A count too small for what was asked raises ValueError rather than quietly giving the mean.

A vector with NaN or infinite entries is refused (ValueError naming its index) by every rule
rather than treated as an outlier: the codecs already refuse such payloads at decoding, so one
here is a local bug, and the caller knows which replica to drop and can aggregate again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dmsc.netmodel.leader_work import sorting_network
from dmsc.runtime.compute.frames import finite
from dmsc.spec.sync_forms import (
    AGGREGATORS,
    DEFAULT_BYZANTINE,
    DEFAULT_TRIM,
    Aggregator,
    AggregatorOptions,
    check_aggregator,
    check_replicas,
    parse_aggregator,
)

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "AggregatorOptions",
    "aggregate",
    "describe",
    "parse_aggregator",
    "summed",
]

_DESCRIPTIONS = {
    "mean": "weighted mean by samples trained on; no protection against a bad replica",
    "median": "coordinate-wise median; tolerates f bad replicas of n >= 2f+1",
    "trimmed-mean": "per coordinate, mean after dropping the floor(trim*n) largest and smallest",
    "krum": "the vector closest to its n-f-2 nearest others (Krum); needs n >= 2f+3",
    "multi-krum": "mean of the n-f vectors of best Krum score; needs n >= 2f+3",
}


def describe(name: str) -> str:
    """One line on what the rule ``name`` does, for command-line help."""
    check_aggregator(name, DEFAULT_BYZANTINE, DEFAULT_TRIM)
    return _DESCRIPTIONS[name]


def aggregate(
    name: str,
    parts: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    *,
    byzantine: int = DEFAULT_BYZANTINE,
    trim: float = DEFAULT_TRIM,
    distances: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Combine the replicas' vectors ``parts`` (same shape, floating point) by rule ``name``
    (the rule's form and how many replicas it needs: :mod:`dmsc.spec.sync_forms`).
    ``distances`` gives Krum's squared distances between the replicas when ``parts`` are
    parts of longer vectors (a tensor-parallel rank's shards: :mod:`.tp_sync`); by default
    those of ``parts``."""
    check_aggregator(name, byzantine, trim)
    _check_parts(parts)
    count = len(parts)
    check_replicas(name, count, byzantine=byzantine, trim=trim)
    if name == "mean":
        return _weighted_mean(parts, _check_weights(weights, count))
    if name == "median":
        return _median(parts)
    if name == "trimmed-mean":
        return _trimmed_mean(parts, math.floor(trim * count))
    order = _krum_order(parts, byzantine, distances)
    if name == "krum":
        return parts[order[0]].clone()
    return _weighted_mean([parts[i] for i in order[: count - byzantine]], None)


def _check_parts(parts: Sequence[torch.Tensor]) -> None:
    if not parts:
        raise ValueError("nothing to aggregate: no vectors")
    first = parts[0]
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise ValueError(f"vector {i} is not a floating-point tensor")
        if p.shape != first.shape or p.dtype != first.dtype or p.device != first.device:
            raise ValueError(
                f"vector {i} is {tuple(p.shape)} {p.dtype} on {p.device}, vector 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
        if not finite(p):
            raise ValueError(f"vector {i} has NaN or infinite entries")


def _check_weights(weights: Sequence[float] | None, count: int) -> list[float] | None:
    if weights is None:
        return None
    w = [float(v) for v in weights]
    if len(w) != count:
        raise ValueError(f"{len(w)} weights for {count} vectors")
    if not all(math.isfinite(v) and v >= 0 for v in w) or sum(w) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {w}")
    return w


def summed(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The elementwise sum of ``parts``, each added in turn to a copy of the first, without
    the ``n x E`` stack ``torch.stack(parts).sum(0)`` needs: 2.4 to 14 times faster for 2 to 16
    vectors of 1M elements in one measurement on this project's CPU, and the same sum but for
    the order of its additions (``sum(0)`` pairs rows for short vectors; for 1M elements it
    added them in turn too). The leader's mean is this over ``n``
    (:mod:`dmsc.netmodel.leader_work` prices it)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


def _weighted_mean(parts: Sequence[torch.Tensor], weights: list[float] | None) -> torch.Tensor:
    # Accumulated in float64 one vector at a time: no n x count stack, and no order-dependent
    # rounding worth speaking of. Each vector is added as it is (the add widens it as it reads:
    # the same sums as converting it first, without the float64 copy).
    w = weights if weights is not None else [1.0] * len(parts)
    total = sum(w)
    acc = torch.zeros(parts[0].shape, dtype=torch.float64, device=parts[0].device)
    for wi, p in zip(w, parts, strict=True):
        if wi:
            acc.add_(p, alpha=wi / total)
    return acc.to(parts[0].dtype)


def _ranked(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The replicas' values sorted per coordinate, smallest first: row ``i`` holds every
    coordinate's ``i``-th smallest. By a sorting network of ``torch.minimum`` and
    ``torch.maximum`` over whole rows (:func:`dmsc.netmodel.leader_work.sorting_network`, as the
    cost model prices it): the median and the trimmed mean of 3 to 16 replicas' 1M elements
    took 3.6 to 7.2 times less than ``torch.sort`` along the replicas alone on this project's
    CPU (``benchmarks/results/leader_work_cpu.json``), the same values."""
    rows = list(torch.stack(list(parts)).unbind(0))  # a copy: the caller's rows stay as sent
    spare = torch.empty_like(rows[0])
    for i, j in sorting_network(len(rows)):
        torch.minimum(rows[i], rows[j], out=spare)
        torch.maximum(rows[i], rows[j], out=rows[j])
        rows[i], spare = spare, rows[i]
    return rows


def _median(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    ranked = _ranked(parts)
    mid = len(parts) // 2
    if len(parts) % 2:
        return ranked[mid].clone()
    return ((ranked[mid - 1].double() + ranked[mid].double()) / 2).to(ranked[mid].dtype)


def _trimmed_mean(parts: Sequence[torch.Tensor], cut: int) -> torch.Tensor:
    kept = _ranked(parts)[cut : len(parts) - cut]
    total = kept[0].to(torch.float64, copy=True)  # never the caller's own tensor
    for row in kept[1:]:
        total.add_(row)
    return total.div_(len(kept)).to(kept[0].dtype)


def _sq_distances(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    count = len(parts)
    dist = torch.zeros(count, count, dtype=torch.float64)
    for i in range(count):
        for j in range(i + 1, count):
            d = torch.linalg.vector_norm(parts[i] - parts[j], dtype=torch.float64)
            dist[i, j] = dist[j, i] = d * d
    return dist


def _krum_order(
    parts: Sequence[torch.Tensor],
    byzantine: int,
    distances: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None,
) -> list[int]:
    """Replica indices from best to worst Krum score, ties to the lower index."""
    count = len(parts)
    dist = (distances or _sq_distances)(parts)
    nearest = count - byzantine - 2
    scores = []
    for i in range(count):
        others = torch.cat([dist[i, :i], dist[i, i + 1 :]])
        scores.append(float(others.sort().values[:nearest].sum()))
    return sorted(range(count), key=lambda i: (scores[i], i))
