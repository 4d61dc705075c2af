from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.planner.segmentation.cuts import (
    SegmentationInfeasible,
    block_cost,
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


@pytest.mark.parametrize("seed", range(8))
def test_tabu_blocks_match_exact_on_small_graphs(seed: int) -> None:
    g = _graph(seed, 7)
    exact = segment_blocks_exact(g, 3, bandwidth=1e9)
    tabu = segment_blocks_tabu(g, 3, bandwidth=1e9, seed=seed)
    assert tabu.cost == pytest.approx(exact.cost)
    assert block_cost(g, tabu.groups, 3, 1e9) == pytest.approx(tabu.cost)


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
