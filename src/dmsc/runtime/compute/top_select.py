"""The ``k`` largest of a long vector of magnitudes, exactly, faster than ``torch.topk`` on a CPU.

The ``topk`` codec (:mod:`.compression`) keeps the ``k = ceil(F n)`` entries of largest
magnitude of a replica's whole gradient every step it is used. ``torch.topk`` over all ``n`` of
them is a selection by comparisons: on this project's 2-core machine, one thread, 4M elements
took 52-97 ms at ``F`` from 0.001 to 0.1, 12 to 23 ns an element where a pass over memory costs
about 0.5 (``benchmarks/codec_work.py`` measures both side by side). Here the selection is
narrowed first, as deep gradient compression (Lin et al., 2018) narrows it with a sampled
threshold, but without giving up exactness:

1. a strided sample of :data:`SAMPLE` magnitudes places a threshold ``t`` that about
   :data:`MARGIN` times ``k`` of the ``n`` exceed (the ``j``-th largest of the sample);
2. the candidates are every entry ``>= t`` (a comparison and the positions of its true
   entries: passes over memory);
3. if there are at least ``k`` of them, the ``k``-th largest candidate ``v`` is found by a
   partial sort of the candidates only, and the answer is every candidate above ``v`` and, of
   those equal to it, the first ones that make ``k``. Every entry at least as large as the
   ``k``-th largest overall is a candidate (the ``k``-th largest is ``>= t``, there being ``k``
   candidates), so the answer is a top-``k`` of the whole vector, and in ascending order, as the
   candidates are: the codec sends its indices sorted, and sorting ``k`` indices took longer than
   the whole narrowing (0.28 ms for 10,486 of 1M). With ties at the ``k``-th value it may keep
   other tied entries than ``torch.topk`` would, as ``torch.topk`` itself promises no order
   among ties;
4. if fewer than ``k`` passed (the sample misjudged the tail), the threshold is placed again at
   twice the margin, and after :data:`TRIES` misses ``torch.topk`` runs over everything.

The narrowing is numpy's (``>=``, ``flatnonzero``, ``partition``) on the tensor's own memory:
on this machine, one thread, the comparison and the positions of 1M magnitudes with 1.5% of
them true took 0.34 ms in numpy, 1.4 ms in torch (``ge`` 0.44, ``nonzero`` 0.97), and 2.0 against
8.5 ms for 4M (``benchmarks/codec_work.py`` times the selection as a whole).

Short vectors, large fractions and vectors off the CPU go to ``torch.topk`` at once
(:func:`narrowed`), where the narrowing cannot pay for its passes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SAMPLE = 8192  # magnitudes sampled to place the threshold
MARGIN = 1.5  # the threshold aims at this many times k candidates
TRIES = 3  # thresholds tried (the margin doubled each time) before torch.topk over everything
MIN_ELEMENTS = 1 << 18  # below this torch.topk over the whole is about as fast
MAX_FRACTION = 0.1  # above this share the candidates are too many to gain


def narrowed(n: int, k: int, device: torch.device | str = "cpu") -> bool:
    """Whether the selection of ``k`` of ``n`` on ``device`` goes through a sampled threshold:
    on the CPU only, where it was measured (a GPU's ``torch.topk`` is a radix select, passes
    over memory already, and the narrowing would copy the vector to the host)."""
    return torch.device(device).type == "cpu" and n >= MIN_ELEMENTS and 0 < k <= MAX_FRACTION * n


def top_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of ``k`` largest entries of the 1-D tensor ``magnitudes``
    (non-negative and finite: the caller checked its input)."""
    n = magnitudes.numel()
    if not 0 <= k <= n:
        raise ValueError(f"top_indices: k = {k} outside [0, {n}]")
    if narrowed(n, k, magnitudes.device):
        found = _narrowed(magnitudes.detach().contiguous().numpy(), k)
        if found is not None:
            return torch.from_numpy(found)
    return torch.topk(magnitudes, k, sorted=False).indices.sort().values


def _narrowed(m: np.ndarray, k: int) -> np.ndarray | None:
    """Ascending positions of ``k`` largest entries of ``m`` through a sampled threshold
    (module docstring), or None when every threshold tried let fewer than ``k`` through."""
    n = m.size
    sample = m[:: max(1, n // SAMPLE)]
    size, margin = sample.size, MARGIN
    for _ in range(TRIES):
        # the j-th largest of the sample: about j n / size entries of the whole lie above it
        j = min(size, math.ceil(margin * k * size / n) + 1)
        threshold = np.partition(sample, size - j)[size - j]
        candidates = np.flatnonzero(m >= threshold)
        if candidates.size >= k:
            return _largest(m, candidates, k)
        margin *= 2
    return None


def _largest(m: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` of the ascending ``candidates`` whose values in ``m`` are largest, ascending:
    those above the ``k``-th largest value, then the first of those equal to it."""
    extra = candidates.size - k
    if extra == 0:
        return candidates
    values = m[candidates]
    kth = np.partition(values, extra)[extra]
    keep = values > kth
    short = k - int(np.count_nonzero(keep))
    keep[np.flatnonzero(values == kth)[:short]] = True
    return candidates[keep]
