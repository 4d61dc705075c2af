"""Intra-datacenter fabrics as graphs (switches, hosts, Gbit/s per link) and what a cost model uses
of one: hosts, diameter in hops, bisection bandwidth per host. The fabrics 003_d6a6c77bfe2272ad.txt
names:

- ``fat-tree``: the k-ary fat tree of Al-Fares et al. (SIGCOMM 2008): k pods of k/2 edge and k/2
  aggregation switches, (k/2)^2 core switches, k^3/4 hosts; full bisection;
- ``dragonfly``: Kim et al. (ISCA 2008): ``groups`` groups of ``a`` routers, all-to-all inside a
  group, ``h`` global links per router spread over the other groups, ``p`` hosts per router;
- ``torus``: a k-ary n-dimensional torus of routers (``dims``), one host each;
- ``hypercube``: a ``d``-dimensional hypercube of routers, one host each.

:func:`fabric_figures`: the bisection is the max flow between two halves of the hosts (networkx),
over the split of the hosts in name order, which the builders make the cheapest one: the tree's
pods, the torus's largest dimension, the cube's first bit, the dragonfly's groups (exact for an
even number of groups; with an odd one, the cut between the smaller and the larger half). A
cluster's datacenter may name its fabric (``network.fabric``): the cost model then gives each
node the fabric's bisection per host and a latency of its diameter in switch hops.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import networkx as nx

from dmsc.spec.cluster import DCNetworkSpec, FabricSpec

FABRICS = ("fat-tree", "dragonfly", "torus", "hypercube")


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
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def summary(spec: FabricSpec) -> dict[str, float]:
    """Hosts, diameter in hops (host to host) and bisection Gbit/s per host of a fabric spec,
    in closed form (the tests check them against :func:`fabric_figures` on the built graph)."""
    bw = spec.gbit_s
    if spec.kind == "fat-tree":
        return {"hosts": spec.k**3 // 4, "diameter_hops": 6, "bisection_gbit_s_per_host": bw}
    if spec.kind == "hypercube":
        return {"hosts": 2**spec.d, "diameter_hops": spec.d + 2, "bisection_gbit_s_per_host": bw}
    if spec.kind == "torus":
        dims = sorted(spec.dims, reverse=True)
        hosts = math.prod(dims)
        cut = 2 * hosts // dims[0] * bw  # two links per ring of the largest dimension
        return {
            "hosts": hosts,
            "diameter_hops": sum(d // 2 for d in dims) + 2,
            "bisection_gbit_s_per_host": cut / (hosts // 2),
        }
    g = spec.groups or spec.a * spec.h + 1
    hosts = g * spec.a * spec.p
    links = min(g * (g - 1) // 2, g * spec.a * spec.h // 2)  # global links built
    # between the two halves of the groups: their share of the global links
    across = links * (g // 2) * (g - g // 2) / (g * (g - 1) / 2)
    return {
        "hosts": hosts,
        "diameter_hops": 5 if g > 1 else 3,
        "bisection_gbit_s_per_host": across * bw / (hosts // 2),
    }


def dc_uplink(network: DCNetworkSpec) -> tuple[float, float]:
    """What one node of a datacenter gets of its network: (Gbit/s, one-way latency in us). With
    a fabric, the bisection per host where it is below the node's uplink, and the fabric's
    diameter in switch hops added to the latency."""
    if network.fabric is None:
        return network.gbit_s_per_node, network.latency_us
    f = summary(network.fabric)
    return (
        min(network.gbit_s_per_node, f["bisection_gbit_s_per_host"]),
        network.latency_us + f["diameter_hops"] * network.fabric.hop_latency_us,
    )
