"""Seeded random placement problems, for tests and the optimality benchmark."""

from __future__ import annotations

import itertools
import random

import networkx as nx

from dmsc.planner.placement.problem import LinkState, PathOption, PlacementProblem


def random_problem(
    seed: int,
    max_dcs: int = 6,
    max_stages: int = 8,
    max_combinations: int = 200_000,
) -> PlacementProblem:
    """A small multi-datacenter instance: a random connected graph of sites, a few stages.

    Sizes are drawn until the brute-force search space (assignments x route options) stays under
    ``max_combinations``, so that brute force can check the exact model on every instance.
    """
    rng = random.Random(seed)
    while True:
        n_dcs = rng.randint(2, max_dcs)
        n_stages = rng.randint(2, max_stages)
        levels = tuple(sorted(rng.sample([1, 2, 3, 4, 6, 8], rng.randint(1, 3))))
        k_paths = rng.randint(1, 2)
        space = n_dcs**n_stages * (k_paths * len(levels)) ** min(n_stages - 1, 3)
        if space <= max_combinations:
            break
    g = (
        nx.connected_watts_strogatz_graph(n_dcs + 2, 2, 0.5, seed=seed)
        if n_dcs > 2
        else nx.path_graph(4)
    )
    sites = sorted(g.nodes)
    dc_sites = sites[:n_dcs]
    links: list[LinkState] = []
    index: dict[frozenset[int], int] = {}
    for u, v in g.edges:
        units = rng.choice([6, 8, 10])
        busy = frozenset(rng.sample(range(units), rng.randint(0, 2)))
        index[frozenset((u, v))] = len(links)
        links.append(LinkState(f"{u}-{v}", units, busy))
        g.edges[u, v]["km"] = rng.choice([150, 300, 600, 900, 1500])
    paths: dict[tuple[int, int], tuple[PathOption, ...]] = {}
    for a, z in itertools.permutations(range(n_dcs), 2):
        opts = []
        for route in itertools.islice(
            nx.shortest_simple_paths(g, dc_sites[a], dc_sites[z], "km"), k_paths
        ):
            hops = [index[frozenset(e)] for e in itertools.pairwise(route)]
            km = sum(g.edges[e]["km"] for e in itertools.pairwise(route))
            opts.append(PathOption(tuple(hops), km, int(km * 5), 12.5 * (4 if km <= 600 else 2)))
        paths[(a, z)] = tuple(opts)
    free = tuple(rng.randint(1, 3) * 8 for _ in range(n_dcs))
    devices = tuple(8 for _ in range(n_stages))
    while sum(devices) > sum(free):
        free = tuple(f + 8 for f in free)
    compute = tuple(
        tuple(
            None if rng.random() < 0.1 and d > 0 else rng.randint(2_000, 20_000)
            for d in range(n_dcs)
        )
        for _ in range(n_stages)
    )
    # Stage 0 fits in DC 0 at least, so that no instance is trivially empty.
    compute = (tuple(c if c is not None else 5_000 for c in compute[0]), *compute[1:])
    boundary = tuple(rng.choice([20e6, 50e6, 100e6, 200e6]) for _ in range(n_stages - 1))
    local = tuple(tuple(rng.randint(50, 400) for _ in range(n_dcs)) for _ in range(n_stages - 1))
    return PlacementProblem(
        dc_names=tuple(f"dc{d}" for d in range(n_dcs)),
        free_devices=free,
        devices=devices,
        compute_us=compute,
        boundary_bytes=boundary,
        local_us=local,
        links=tuple(links),
        paths=paths,
        levels=levels,
        microbatches=rng.choice([4, 8, 16]),
        chunks=1,
    )
