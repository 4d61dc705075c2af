from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.netmodel import (
    DEFAULT_CALIBRATION,
    CommModel,
    Topology,
    all_reduce_lower_bound,
    ring_time,
)
from dmsc.netmodel.collectives import COLLECTIVES
from dmsc.spec import ClusterSpec

C = DEFAULT_CALIBRATION


def _cluster(node_gbit: float = 1600, link_gbit: float = 2400) -> ClusterSpec:
    return ClusterSpec.model_validate(
        {
            "device_types": {
                "g": {"peak_tflops": {"bf16": 100}, "memory_gib": 80, "memory_bw_gbyte_s": 2000}
            },
            "node_types": {
                "n": {
                    "device": "g",
                    "devices": 8,
                    "link": {"bandwidth_gbit_s": link_gbit, "latency_us": 1},
                }
            },
            "datacenters": [
                {
                    "name": "a",
                    "nodes": [{"type": "n", "count": 4}],
                    "network": {"gbit_s_per_node": node_gbit, "latency_us": 2},
                }
            ],
        }
    )


def test_intra_node_ring_uses_the_device_links() -> None:
    comm = CommModel(Topology(_cluster()), C)
    m = 100e6
    cost = comm.collective("all_reduce", [tuple(range(8))], m, "ring")
    bw = 2400e9 / 8 * C.intra_node_link_efficiency
    expected = ring_time("all_reduce", 8, m, bw, 2e-6) + C.collective_overhead_s
    assert cost.time_s == pytest.approx(expected)


def test_concurrent_rings_share_the_node_uplink() -> None:
    comm = CommModel(Topology(_cluster()), C)
    m = 1e9
    one = comm.collective("all_reduce", [(0, 8, 16, 24)], m, "ring")
    eight = comm.collective("all_reduce", [(i, 8 + i, 16 + i, 24 + i) for i in range(8)], m, "ring")
    uplink = 1600e9 / 8 * C.network_link_efficiency
    assert one.time_s == pytest.approx(
        ring_time("all_reduce", 4, m, uplink, 6e-6) + C.collective_overhead_s
    )
    assert eight.time_s == pytest.approx(
        ring_time("all_reduce", 4, m, uplink / 8, 6e-6) + C.collective_overhead_s
    )


def test_hierarchical_beats_flat_ring_on_a_slow_network() -> None:
    # A flat ring pushes 2(n-1)/n of the buffer through every node uplink, the hierarchical
    # all-reduce 2(N-1)/N for N nodes: it wins when the uplink is the bottleneck.
    comm = CommModel(Topology(_cluster(node_gbit=200)), C)
    group = [tuple(range(32))]
    flat = comm.collective("all_reduce", group, 1e9, "ring")
    hier = comm.collective("all_reduce", group, 1e9, "hierarchical")
    auto = comm.collective("all_reduce", group, 1e9, "auto")
    assert hier.time_s < flat.time_s
    assert auto.time_s == min(flat.time_s, hier.time_s, auto.time_s)
    # Node-level cut bound: every node must send 2(N-1)/N of the buffer through its uplink.
    uplink = 200e9 / 8
    assert hier.time_s >= all_reduce_lower_bound(4, 1e9, uplink)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(COLLECTIVES),
    st.sampled_from(["ring", "tree", "hierarchical", "auto"]),
    st.floats(1e3, 1e10),
    st.floats(1.0, 20.0),
)
def test_more_bandwidth_never_slower_on_topology(
    kind: str, algo: str, m: float, factor: float
) -> None:
    slow = CommModel(Topology(_cluster()), C)
    fast = CommModel(Topology(_cluster(1600 * factor, 2400 * factor)), C)
    groups = [tuple(range(0, 32, 4)), tuple(range(1, 32, 4))]
    if kind == "p2p":
        groups = [(0, 9), (1, 17)]
    a = slow.collective(kind, groups, m, algo)  # type: ignore[arg-type]
    b = fast.collective(kind, groups, m, algo)  # type: ignore[arg-type]
    assert b.time_s <= a.time_s * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(COLLECTIVES),
    st.sampled_from(["ring", "tree", "hierarchical"]),
    st.floats(1e3, 1e10),
)
def test_every_byte_leaves_and_enters_a_device_link(kind: str, algo: str, m: float) -> None:
    topo = Topology(_cluster())
    comm = CommModel(topo, C)
    groups = [tuple(range(0, 32, 2)), tuple(range(1, 32, 2))]
    if kind == "p2p":
        groups = [(0, 9), (1, 17)]
    cost = comm.collective(kind, groups, m, algo)  # type: ignore[arg-type]
    on_device_links = sum(
        b for lid, b in cost.link_bytes.items() if topo.links[lid].kind == "device"
    )
    assert on_device_links == pytest.approx(2 * cost.bytes_sent)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 32), st.floats(1e3, 1e10))
def test_flat_ring_respects_bandwidth_bound(n: int, m: float) -> None:
    topo = Topology(_cluster())
    comm = CommModel(topo, C)
    group = tuple(range(n))
    cost = comm.collective("all_reduce", [group], m, "auto")
    # The fastest link any rank has into the network bounds the all-reduce.
    fastest = 2400e9 / 8 if n <= 8 else 1600e9 / 8
    nodes = max(1, (n + 7) // 8)
    bound = (
        all_reduce_lower_bound(n, m, fastest)
        if n <= 8
        else all_reduce_lower_bound(nodes, m, fastest)
    )
    assert cost.time_s >= bound * (1 - 1e-9)


def test_hierarchical_across_datacenters() -> None:
    spec = _cluster().model_dump()
    spec["datacenters"] = [
        {
            "name": name,
            "nodes": [{"type": "n", "count": 2}],
            "network": {"gbit_s_per_node": 1600, "latency_us": 2},
        }
        for name in ("east", "west")
    ]
    spec["links"] = [{"a": "east", "b": "west", "km": 500, "bandwidth_gbit_s": 100}]
    topo = Topology(ClusterSpec.model_validate(spec))
    comm = CommModel(topo, C)
    group = [tuple(range(32))]
    m = 1e9
    flat = comm.collective("all_reduce", group, m, "ring")
    best = comm.collective("all_reduce", group, m, "auto")
    assert best.time_s < flat.time_s / 1.5
    # Cut bound: each datacenter must send half the buffer over the 100 Gbit/s fiber.
    assert best.time_s >= all_reduce_lower_bound(2, m, 100e9 / 8)
    fiber = next(link.id for link in topo.links if link.kind == "interdc")
    # The flat ring crosses the fiber twice with 2(n-1)/n of the buffer; the hierarchical
    # all-reduce has 16 pairs of shards (m/16 each) that each rank sends once over it: 2m.
    assert flat.link_bytes[fiber] == pytest.approx(2 * 2 * 31 / 32 * m)
    assert best.link_bytes[fiber] == pytest.approx(2 * m)


def test_the_algorithm_an_all_reduce_comes_to() -> None:
    """What a runtime should run: auto the fastest of the three, hierarchical the ring where
    the group does not split into equal domains."""
    comm = CommModel(Topology(_cluster(node_gbit=200)), C)
    group = [tuple(range(32))]  # 4 nodes of 8
    for m in (1e3, 1e9):
        times = {a: comm.collective("all_reduce", group, m, a).time_s for a in ("ring", "tree")}
        times["hierarchical"] = comm.collective("all_reduce", group, m, "hierarchical").time_s
        assert comm.all_reduce_choice(group, m) == min(times, key=times.__getitem__)
        assert comm.all_reduce_choice(group, m, "tree") == "tree"
    assert comm.all_reduce_choice(group, 1e9) == "hierarchical"
    assert comm.all_reduce_choice([(0, 1, 2)], 1e9, "hierarchical") == "ring"  # one node
    assert comm.all_reduce_choice([(0,)], 1e9) == "ring"  # nothing to reduce


def test_a_star_puts_every_payload_on_the_leaders_link() -> None:
    """The leader's star (robust aggregators, privacy, secure aggregation): every member's
    payload into the first member at once, then the result back out to each, point to point.
    By hand: 3 followers share the leader's device link, each way ``a + 3 m / bw``."""
    from dmsc.netmodel.collectives import p2p_time

    comm = CommModel(Topology(_cluster()), C)
    m = 100e6
    cost = comm.star([(0, 1, 2, 3)], m, m)
    bw = 2400e9 / 8 * C.intra_node_link_efficiency
    one_way = p2p_time(3 * m, bw, 2e-6) + C.collective_overhead_s
    assert cost.time_s == pytest.approx(2 * one_way)
    assert cost.bytes_sent == pytest.approx(6 * m)  # 3 payloads in, 3 out
    assert max(cost.link_bytes.values()) == pytest.approx(6 * m)  # the leader's link
    # the ring all-reduce puts 2 (n - 1) / n of a payload on each link, and is faster
    ring = comm.collective("all_reduce", [(0, 1, 2, 3)], m, "ring")
    assert max(ring.link_bytes.values()) < max(cost.link_bytes.values())
    assert ring.time_s < cost.time_s
    # two groups at once: the same time (their links are their own); the result may be larger
    assert comm.star([(0, 1), (2, 3)], m, m).time_s == pytest.approx(
        2 * (p2p_time(m, bw, 2e-6) + C.collective_overhead_s)
    )
    back = comm.star([(0, 1, 2, 3)], m, 2 * m)
    out = p2p_time(6 * m, bw, 2e-6) + C.collective_overhead_s  # 2 m to each of 3 at once
    assert back.time_s == pytest.approx(one_way + out)
