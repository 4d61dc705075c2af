"""Generated topologies: inter-datacenter graphs with fiber lengths, and intra-datacenter fabrics.

Inter-DC graphs (sites in a square of ``side_km``, links with their straight-line length, seeded):

- ``full-mesh``: every pair of sites linked;
- ``star``: one hub (the site nearest the centre) linked to every other;
- ``ring``: the sites in angular order around their centroid, each linked to the next;
- ``waxman``: Waxman's random graph (Waxman, IEEE JSAC 1988): sites ``u, v`` at distance ``d``
  are linked with probability ``beta * exp(-d / (alpha * L))``, ``L`` the largest distance;
  drawn again until connected;
- ``clustered``: ``clusters`` groups of sites around their own centres, each group a ring, the
  groups' nearest sites linked into a ring of groups (metro rings joined by a core).

Intra-DC fabrics (fat tree, dragonfly, torus, hypercube) are :mod:`dmsc.netmodel.fabrics`'s, the
cost model's, re-exported here for ``dmsc topology generate``.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import networkx as nx

from dmsc.netmodel.fabrics import (
    FABRIC_BUILDERS,
    FABRICS,
    dragonfly,
    fabric_figures,
    fat_tree,
    hypercube,
    torus,
)

__all__ = [
    "FABRICS",
    "FABRIC_BUILDERS",
    "INTER_DC",
    "dragonfly",
    "fabric_figures",
    "fat_tree",
    "hypercube",
    "inter_dc",
    "torus",
]

INTER_DC = ("full-mesh", "star", "ring", "waxman", "clustered")


def _sites(n: int, side_km: float, rng: random.Random) -> dict[str, tuple[float, float]]:
    return {f"s{i}": (rng.uniform(0, side_km), rng.uniform(0, side_km)) for i in range(n)}


def _km(pos: dict[str, tuple[float, float]], a: str, b: str) -> float:
    (x1, y1), (x2, y2) = pos[a], pos[b]
    return round(max(1.0, math.hypot(x1 - x2, y1 - y2)), 1)


def _graph(pos: dict[str, tuple[float, float]], pairs: Any) -> nx.Graph:
    g = nx.Graph()
    for name, xy in pos.items():
        g.add_node(name, pos=xy)
    for a, b in pairs:
        if a != b:
            g.add_edge(a, b, km=_km(pos, a, b))
    return g


def _ring_order(pos: dict[str, tuple[float, float]]) -> list[str]:
    cx = sum(x for x, _ in pos.values()) / len(pos)
    cy = sum(y for _, y in pos.values()) / len(pos)
    return sorted(pos, key=lambda s: math.atan2(pos[s][1] - cy, pos[s][0] - cx))


def inter_dc(
    kind: str,
    n: int,
    seed: int = 0,
    side_km: float = 2000.0,
    alpha: float = 0.4,
    beta: float = 0.6,
    clusters: int = 3,
) -> nx.Graph:
    """An inter-DC graph of ``n`` sites (see the module docstring); every edge has ``km``."""
    if kind not in INTER_DC:
        raise ValueError(f"unknown graph {kind!r} (graphs: {', '.join(INTER_DC)})")
    if n < 2 or (kind == "ring" and n < 3):
        raise ValueError(f"{kind} needs at least {3 if kind == 'ring' else 2} sites")
    rng = random.Random(seed)
    pos = _sites(n, side_km, rng)
    if kind == "full-mesh":
        return _graph(pos, itertools.combinations(pos, 2))
    if kind == "star":
        hub = min(pos, key=lambda s: math.hypot(pos[s][0] - side_km / 2, pos[s][1] - side_km / 2))
        return _graph(pos, ((hub, s) for s in pos))
    if kind == "ring":
        order = _ring_order(pos)
        return _graph(pos, zip(order, order[1:] + order[:1], strict=True))
    if kind == "waxman":
        if not (alpha > 0 and 0 < beta <= 1):
            raise ValueError("waxman needs alpha > 0 and 0 < beta <= 1")
        far = max(_km(pos, a, b) for a, b in itertools.combinations(pos, 2))
        for _ in range(1000):
            pairs = [
                (a, b)
                for a, b in itertools.combinations(pos, 2)
                if rng.random() < beta * math.exp(-_km(pos, a, b) / (alpha * far))
            ]
            g = _graph(pos, pairs)
            if nx.is_connected(g):
                return g
        raise ValueError("waxman: no connected graph in 1000 draws: raise alpha or beta")
    if not 1 <= clusters <= n // 3:
        raise ValueError(f"clustered: 1 to {n // 3} clusters of at least 3 sites each")
    centres = [(rng.uniform(0, side_km), rng.uniform(0, side_km)) for _ in range(clusters)]
    spread = side_km / (4 * clusters)
    names = list(pos)
    groups = [names[i::clusters] for i in range(clusters)]
    for c, group in zip(centres, groups, strict=True):
        for s in group:
            pos[s] = (c[0] + rng.gauss(0, spread), c[1] + rng.gauss(0, spread))
    pairs = []
    for group in groups:
        order = _ring_order({s: pos[s] for s in group})
        pairs += list(zip(order, order[1:] + order[:1], strict=True))
    for g1, g2 in zip(groups, groups[1:] + groups[:1], strict=True):
        if g1 is not g2:
            pairs.append(min(itertools.product(g1, g2), key=lambda p: _km(pos, *p)))
    return _graph(pos, pairs)
