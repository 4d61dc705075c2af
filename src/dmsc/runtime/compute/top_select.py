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
2. the candidates are every entry ``>= t`` (a comparison and ``nonzero``: passes over memory);
3. if there are at least ``k`` of them, ``torch.topk`` among the candidates only. Every entry
   at least as large as the ``k``-th largest overall is then a candidate (the ``k``-th largest
   is ``>= t``, there being ``k`` candidates), so the answer is a top-``k`` of the whole vector;
   with ties at the ``k``-th value it may keep other tied entries than ``torch.topk`` would, as
   ``torch.topk`` itself promises no order among ties;
4. if fewer than ``k`` passed (the sample misjudged the tail), the threshold is placed again at
   twice the margin, and after :data:`TRIES` misses ``torch.topk`` runs over everything.

Short vectors, large fractions and vectors off the CPU go to ``torch.topk`` at once
(:func:`narrowed`), where the narrowing cannot pay for its passes.
"""

from __future__ import annotations

import math

import torch

SAMPLE = 8192  # magnitudes sampled to place the threshold
MARGIN = 1.5  # the threshold aims at this many times k candidates
TRIES = 3  # thresholds tried (the margin doubled each time) before torch.topk over everything
MIN_ELEMENTS = 1 << 18  # below this torch.topk over the whole is about as fast
MAX_FRACTION = 0.1  # above this share the candidates are too many to gain


def narrowed(n: int, k: int, device: torch.device | str = "cpu") -> bool:
    """Whether the selection of ``k`` of ``n`` on ``device`` goes through a sampled threshold:
    on the CPU only, where it was measured (a GPU's ``torch.topk`` is a radix select, passes
    over memory already, and the narrowing's ``nonzero`` waits for the device)."""
    return torch.device(device).type == "cpu" and n >= MIN_ELEMENTS and 0 < k <= MAX_FRACTION * n


def top_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, in no particular order) of ``k`` largest entries of the 1-D tensor
    ``magnitudes`` (non-negative and finite: the caller checked its input)."""
    n = magnitudes.numel()
    if not 0 <= k <= n:
        raise ValueError(f"top_indices: k = {k} outside [0, {n}]")
    if not narrowed(n, k, magnitudes.device):
        return torch.topk(magnitudes, k, sorted=False).indices
    sample = magnitudes[:: max(1, n // SAMPLE)]
    m, margin = sample.numel(), MARGIN
    for _ in range(TRIES):
        # the j-th largest of the sample: about j n / m entries of the whole lie above it
        j = min(m, math.ceil(margin * k * m / n) + 1)
        threshold = float(torch.topk(sample, j, sorted=False).values.min())
        candidates = (magnitudes >= threshold).nonzero(as_tuple=True)[0]
        if candidates.numel() >= k:
            return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
        margin *= 2
    return torch.topk(magnitudes, k, sorted=False).indices
