"""Closed forms of the collective operations under the latency-bandwidth (alpha-beta) model.

``n`` ranks, ``nbytes`` the size of the full buffer (the input of a reduce/all-reduce/scatter, the
output of a gather/all-gather), ``bw`` the bandwidth in bytes/s of the slowest hop the algorithm
uses (already shared among the flows that cross it), ``alpha`` the latency of one step on that hop.
References: Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005); Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms" (JPDC 2009);
NCCL's double binary trees (Sanders et al. 2009).
"""

from __future__ import annotations

import math
from typing import Literal

CollectiveKind = Literal[
    "p2p",
    "broadcast",
    "reduce",
    "scatter",
    "gather",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_reduce",
]
AllReduceAlgorithm = Literal["ring", "tree", "hierarchical"]
COLLECTIVES: tuple[CollectiveKind, ...] = (
    "p2p",
    "broadcast",
    "reduce",
    "scatter",
    "gather",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_reduce",
)


def _check(n: int, nbytes: float, bw: float, alpha: float) -> None:
    if n < 1 or nbytes < 0 or bw <= 0 or alpha < 0:
        raise ValueError(f"bad collective arguments n={n} nbytes={nbytes} bw={bw} alpha={alpha}")


def p2p_time(nbytes: float, bw: float, alpha: float) -> float:
    """One message between two ranks."""
    _check(2, nbytes, bw, alpha)
    return alpha + nbytes / bw if nbytes else 0.0


def ring_time(kind: CollectiveKind, n: int, nbytes: float, bw: float, alpha: float) -> float:
    """Time of ``kind`` over ``n`` ranks with the ring (pipelined chain) algorithm."""
    _check(n, nbytes, bw, alpha)
    if n == 1 or nbytes == 0:
        return 0.0
    if kind == "p2p":
        return p2p_time(nbytes, bw, alpha)
    frac = (n - 1) / n
    if kind in ("broadcast", "reduce"):
        # Pipelined along the chain: the buffer streams once through the slowest hop.
        return (n - 1) * alpha + nbytes / bw
    if kind in ("scatter", "gather", "all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * alpha + frac * nbytes / bw
    if kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * frac * nbytes / bw
    raise ValueError(f"unknown collective {kind!r}")


def tree_all_reduce_time(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """All-reduce as a pipelined reduce up and broadcast down a binary tree (NCCL's tree).

    Fewer steps than the ring (latency grows with log n) but each byte crosses the busiest link
    twice, so for large buffers it is slower by n/(n-1).
    """
    _check(n, nbytes, bw, alpha)
    if n == 1 or nbytes == 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw


def all_reduce_lower_bound(n: int, nbytes: float, bw: float) -> float:
    """No all-reduce over ``n`` ranks, each with ``bw`` into the network, can be faster."""
    return 2 * (n - 1) / n * nbytes / bw if n > 1 else 0.0


def bytes_sent_per_rank(kind: CollectiveKind, n: int, nbytes: float) -> float:
    """Bytes one rank puts on the network, on average, for the ring/pairwise algorithms."""
    if n == 1:
        return 0.0
    frac = (n - 1) / n
    if kind == "p2p":
        return nbytes / 2  # one of the two ranks sends everything
    if kind in ("broadcast", "reduce"):
        return nbytes * frac  # n-1 of the n ranks forward the whole buffer
    if kind in ("scatter", "gather"):
        return frac * nbytes / n  # the root sends (n-1)/n of the buffer, spread over n ranks
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return frac * nbytes
    if kind == "all_reduce":
        return 2 * frac * nbytes
    raise ValueError(f"unknown collective {kind!r}")
