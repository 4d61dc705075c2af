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

Intra-DC fabrics (switches and hosts, each link with its Gbit/s), as 003_d6a6c77bfe2272ad.txt
names them:

- ``fat-tree``: the k-ary fat tree of Al-Fares et al. (SIGCOMM 2008): k pods of k/2 edge and k/2
  aggregation switches, (k/2)^2 core switches, k^3/4 hosts; full bisection;
- ``dragonfly``: Kim et al. (ISCA 2008): ``groups`` groups of ``a`` routers, all-to-all inside a
  group, ``h`` global links per router spread over the other groups, ``p`` hosts per router;
- ``torus``: a k-ary n-dimensional torus of routers (``dims``), one host each;
- ``hypercube``: a ``d``-dimensional hypercube of routers, one host each.

:func:`fabric_figures` gives what a cost model uses of a fabric: hosts, diameter in hops and the
bisection bandwidth per host (the max flow between two halves of the hosts, by networkx, over
the split of the hosts in name order, which the builders make the cheapest one: the tree's
pods, the torus's largest dimension, the cube's first bit, the dragonfly's groups).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from typing import Any

import networkx as nx

INTER_DC = ("full-mesh", "star", "ring", "waxman", "clustered")
FABRICS = ("fat-tree", "dragonfly", "torus", "hypercube")


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


def fat_tree(k: int, gbit_s: float = 400.0) -> nx.Graph:
    if k < 2 or k % 2:
        raise ValueError("a fat tree needs an even k >= 2")
    g = nx.Graph()
    half = k // 2
    cores = [f"core{i}" for i in range(half * half)]
    for p in range(k):
        aggs = [f"p{p}agg{i}" for i in range(half)]
        edges = [f"p{p}edge{i}" for i in range(half)]
        for i, agg in enumerate(aggs):
            for j in range(half):
                g.add_edge(agg, cores[i * half + j], gbit_s=gbit_s)
            for edge in edges:
                g.add_edge(agg, edge, gbit_s=gbit_s)
        for i, edge in enumerate(edges):
            for h in range(half):
                _host(g, edge, f"p{p}e{i}h{h}", gbit_s)
    return _roles(g)


def dragonfly(a: int, p: int, h: int, groups: int | None = None, gbit_s: float = 400.0) -> nx.Graph:
    """``groups`` defaults to the largest balanced one, a*h + 1."""
    n_groups = groups if groups is not None else a * h + 1
    if min(a, p, h) < 1 or not 2 <= n_groups <= a * h + 1:
        raise ValueError(f"a dragonfly needs a, p, h >= 1 and 2 to {a * h + 1} groups")
    g = nx.Graph()
    for grp in range(n_groups):
        routers = [f"g{grp}r{i}" for i in range(a)]
        for r1, r2 in itertools.combinations(routers, 2):
            g.add_edge(r1, r2, gbit_s=gbit_s)
        for i, r in enumerate(routers):
            for j in range(p):
                _host(g, r, f"g{grp}r{i}h{j}", gbit_s)
    # global links: group pairs in turn, each over the next router with a free global port
    ports = {grp: [(f"g{grp}r{i}", h) for i in range(a)] for grp in range(n_groups)}
    used = {r: 0 for grp in ports for r, _ in ports[grp]}

    def free(grp: int) -> str | None:
        return next((r for r, cap in ports[grp] if used[r] < cap), None)

    for g1, g2 in itertools.combinations(range(n_groups), 2):
        end1, end2 = free(g1), free(g2)
        if end1 is None or end2 is None:
            continue
        used[end1] += 1
        used[end2] += 1
        g.add_edge(end1, end2, gbit_s=gbit_s)
    return _roles(g)


def torus(dims: tuple[int, ...], gbit_s: float = 400.0) -> nx.Graph:
    if not dims or any(d < 2 for d in dims):
        raise ValueError("a torus needs dimensions of 2 or more")
    # the largest dimension first: the host order fabric_figures splits in halves then cuts
    # across it, the cheapest cut (exact when that dimension is even)
    sizes = sorted(dims, reverse=True)
    g = nx.Graph()
    for u in itertools.product(*(range(d) for d in sizes)):
        for axis, d in enumerate(sizes):
            v = tuple((x + 1) % d if i == axis else x for i, x in enumerate(u))
            if v != u:
                g.add_edge(f"r{u}", f"r{v}", gbit_s=gbit_s)
        _host(g, f"r{u}", f"r{u}h", gbit_s)
    return _roles(g)


def hypercube(d: int, gbit_s: float = 400.0) -> nx.Graph:
    if not 1 <= d <= 12:
        raise ValueError("a hypercube needs 1 to 12 dimensions")
    base = nx.hypercube_graph(d)
    g = nx.Graph()
    for u, v in base.edges:
        g.add_edge(f"r{u}", f"r{v}", gbit_s=gbit_s)
    for u in base.nodes:
        _host(g, f"r{u}", f"r{u}h", gbit_s)
    return _roles(g)


def _host(g: nx.Graph, switch: str, name: str, gbit_s: float) -> None:
    g.add_node(name, role="host")
    g.add_edge(switch, name, gbit_s=gbit_s)


def _roles(g: nx.Graph) -> nx.Graph:
    """Every vertex that is not a host is a switch (or router)."""
    for v in g.nodes:
        g.nodes[v].setdefault("role", "switch")
    return g


FABRIC_BUILDERS: dict[str, Callable[..., nx.Graph]] = {
    "fat-tree": fat_tree,
    "dragonfly": dragonfly,
    "torus": torus,
    "hypercube": hypercube,
}


def fabric_figures(g: nx.Graph) -> dict[str, Any]:
    """Hosts, switches, links, diameter (hops between hosts) and bisection Gbit/s per host."""
    hosts = sorted((v for v, r in g.nodes(data="role") if r == "host"), key=_natural)
    switches = g.number_of_nodes() - len(hosts)
    half = len(hosts) // 2
    flow = nx.DiGraph()
    for u, v, bw in g.edges(data="gbit_s"):
        flow.add_edge(u, v, capacity=bw)
        flow.add_edge(v, u, capacity=bw)
    for h in hosts[:half]:
        flow.add_edge("SRC", h, capacity=math.inf)
    for h in hosts[half:]:
        flow.add_edge(h, "DST", capacity=math.inf)
    cut = nx.maximum_flow_value(flow, "SRC", "DST") if half else 0.0
    diameter = nx.diameter(g) if nx.is_connected(g) else math.inf
    return {
        "hosts": len(hosts),
        "switches": switches,
        "links": g.number_of_edges(),
        "diameter_hops": diameter,
        "bisection_gbit_s": cut,
        "bisection_gbit_s_per_host": cut / half if half else 0.0,
    }


def _natural(name: str) -> list[Any]:
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
