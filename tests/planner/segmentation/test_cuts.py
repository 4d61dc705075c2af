from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.planner.segmentation.cuts import (
    CyclicBlockGraph,
    SegmentationInfeasible,
    block_cost,
    block_order,
    group_inputs,
    segment_blocks_exact,
    segment_blocks_tabu,
    segment_business,
    segment_layers,
    segment_layers_bruteforce,
)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(0.1, 10.0), min_size=2, max_size=10),
    st.integers(1, 4),
    st.data(),
)
def test_dynamic_program_equals_enumeration(
    layers: list[float], k: int, data: st.DataObject
) -> None:
    k = min(k, len(layers))
    n = len(layers)
    memory = data.draw(st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n))
    send = data.draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    speeds = data.draw(st.lists(st.floats(0.5, 3.0), min_size=k, max_size=k))
    caps = data.draw(st.lists(st.floats(2.0, 30.0), min_size=k, max_size=k))
    offsets = data.draw(st.lists(st.floats(0.0, 2.0), min_size=k, max_size=k))
    acts = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    inflight = data.draw(st.lists(st.floats(0.0, 4.0), min_size=k, max_size=k))
    extra = (offsets, acts, inflight)
    try:
        ref = segment_layers_bruteforce(layers, memory, send, speeds, caps, *extra)
    except SegmentationInfeasible:
        with pytest.raises(SegmentationInfeasible):
            segment_layers(layers, memory, send, speeds, caps, *extra)
        return
    dp = segment_layers(layers, memory, send, speeds, caps, *extra)
    assert dp.cost == pytest.approx(ref.cost)
    assert [len(r) for r in dp.ranges if len(r)] == [len(r) for r in dp.ranges]
    assert sum(len(r) for r in dp.ranges) == n


def test_heterogeneous_stages_get_more_layers_when_faster() -> None:
    seg = segment_layers([1.0] * 12, [0.0] * 12, [0.0] * 12, [1.0, 3.0], [math.inf] * 2)
    assert [len(r) for r in seg.ranges] == [3, 9]
    assert seg.cost == pytest.approx(3.0)


def test_memory_forces_the_cut() -> None:
    seg = segment_layers([1.0] * 6, [1.0] * 6, [0.0] * 6, [1.0, 1.0], [2.0, 10.0])
    assert [len(r) for r in seg.ranges] == [2, 4]
    with pytest.raises(SegmentationInfeasible):
        segment_layers([1.0] * 6, [1.0] * 6, [0.0] * 6, [1.0, 1.0], [2.0, 2.0])
    with pytest.raises(SegmentationInfeasible):
        segment_layers([1.0] * 2, [0.0] * 2, [0.0] * 2, [1.0] * 3, [1.0] * 3)


def _graph(seed: int, n: int) -> nx.DiGraph:
    import random

    rng = random.Random(seed)
    g = nx.gn_graph(n, seed=seed).reverse()  # a random tree of blocks, edges parent -> child
    g = nx.relabel_nodes(g, {i: f"b{i}" for i in range(n)})
    for node in g.nodes:
        g.nodes[node]["compute"] = rng.uniform(1, 10)
        g.nodes[node]["memory"] = rng.uniform(0, 3)
    for u, v in g.edges:
        g.edges[u, v]["bytes"] = rng.uniform(1e8, 1e9)
    return g


def _dag(seed: int, n: int) -> nx.DiGraph:
    """A random DAG of blocks with joins and forks; names shuffled so that their alphabetical
    order is not a topological one."""
    import random

    rng = random.Random(seed)
    names = [f"b{i}" for i in range(n)]
    rng.shuffle(names)
    g = nx.DiGraph()
    for i, name in enumerate(names):
        g.add_node(name, compute=rng.uniform(1, 10), memory=rng.uniform(0, 3))
        for j in range(i):
            if rng.random() < 0.35:
                g.add_edge(names[j], name, bytes=rng.uniform(1e8, 1e9))
    return g


def _chain_bruteforce(
    graph: nx.DiGraph, k: int, bandwidth: float, memory: float = math.inf
) -> float | None:
    """The reference: every assignment of blocks to groups, kept when every group is used,
    within memory, and no edge goes to an earlier group; the least cost (None: no grouping)."""
    import itertools

    nodes = list(graph.nodes)
    best = None
    for combo in itertools.product(range(k), repeat=len(nodes)):
        groups = dict(zip(nodes, combo, strict=True))
        if len(set(combo)) != k or any(groups[u] > groups[v] for u, v in graph.edges):
            continue
        used = [0.0] * k
        for node in nodes:
            used[groups[node]] += graph.nodes[node]["memory"]
        if max(used) > memory:
            continue
        c = block_cost(graph, groups, k, bandwidth)
        best = c if best is None else min(best, c)
    return best


def _assert_chain(g: nx.DiGraph, groups: dict[str, int], k: int) -> None:
    assert sorted(groups) == sorted(g.nodes) and set(groups.values()) == set(range(k))
    assert all(groups[u] <= groups[v] for u, v in g.edges), "data flows back to a group"


@pytest.mark.parametrize("seed", range(8))
def test_tabu_blocks_match_exact_on_small_graphs(seed: int) -> None:
    g = _graph(seed, 7)
    exact = segment_blocks_exact(g, 3, bandwidth=1e9)
    tabu = segment_blocks_tabu(g, 3, bandwidth=1e9, seed=seed)
    assert tabu.cost == pytest.approx(exact.cost)
    assert block_cost(g, tabu.groups, 3, 1e9) == pytest.approx(tabu.cost)


@pytest.mark.parametrize("seed", range(16))
def test_block_groups_form_a_chain_and_match_brute_force(seed: int) -> None:
    g = _dag(seed, 6) if seed % 2 else _graph(seed, 6)
    k = 2 + seed % 3
    memory = math.inf if seed % 4 < 2 else 6.0
    ref = _chain_bruteforce(g, k, 1e9, memory)
    if ref is None:
        with pytest.raises(SegmentationInfeasible):
            segment_blocks_exact(g, k, 1e9, memory)
        return
    for seg in (
        segment_blocks_exact(g, k, 1e9, memory),
        segment_blocks_tabu(g, k, 1e9, memory, seed=seed),
    ):
        _assert_chain(g, seg.groups, k)
        assert seg.cost == pytest.approx(ref)
        assert block_cost(g, seg.groups, k, 1e9) == pytest.approx(seg.cost)
        reads = group_inputs(g, seg.groups, k)
        assert all(r < j for j, rs in enumerate(reads) for r in rs)


def test_a_branching_graph_is_not_split_backwards() -> None:
    """A trunk feeding two heads: the best split is {trunk, light head} | {heavy head}, and the
    trunk's group must come first (it feeds the other)."""
    g = nx.DiGraph()
    for name, compute in (("z_trunk", 4.0), ("a_head", 5.0), ("b_head", 1.0)):
        g.add_node(name, compute=compute, memory=0.0)
    g.add_edge("z_trunk", "a_head", bytes=1.0)
    g.add_edge("z_trunk", "b_head", bytes=1.0)
    for solve in (segment_blocks_exact, segment_blocks_tabu):
        seg = solve(g, 2, 1e9)
        _assert_chain(g, seg.groups, 2)
        assert seg.groups == {"z_trunk": 0, "b_head": 0, "a_head": 1}
        assert group_inputs(g, seg.groups, 2) == [[], [0]]


def test_a_cycle_is_refused_and_named() -> None:
    g = _graph(3, 5)
    g.add_edge("b3", "b0", bytes=1.0)  # b0 reaches every block of the tree: now a cycle
    with pytest.raises(CyclicBlockGraph, match=r"cycle: b0 -> .*b3 -> b0") as info:
        block_order(g)
    assert info.value.cycle[0] == "b0" and "b3" in info.value.cycle
    for solve in (segment_blocks_exact, segment_blocks_tabu):
        with pytest.raises(CyclicBlockGraph):
            solve(g, 2, 1e9)


def test_block_memory_limit() -> None:
    g = _graph(1, 6)
    with pytest.raises(SegmentationInfeasible):
        segment_blocks_exact(g, 2, 1e9, memory=0.1)
    limited = segment_blocks_tabu(g, 2, 1e9, memory=10.0)
    assert limited.cost < math.inf


def test_business_segmentation() -> None:
    micro = segment_business(["emb", "l0", "l1"], {"qa": ["qa_head"], "cls": ["pool", "fc"]})
    assert [m.name for m in micro] == ["backbone", "head:cls", "head:qa"]
    assert micro[1].reads_from == "backbone" and micro[1].layers == ("pool", "fc")
    with pytest.raises(ValueError):
        segment_business([], {})
