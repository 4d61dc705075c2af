from __future__ import annotations

import itertools

import networkx as nx
import pytest

from dmsc.netmodel import Topology, choose_modulation
from dmsc.spec import ClusterSpec


def test_structural_paths_match_networkx(nsfnet: ClusterSpec) -> None:
    topo = Topology(nsfnet)
    g = topo.graph
    pairs = [(0, 1), (0, 9), (0, 300), (5, 1000), (700, 12), (255, 256)]
    for a, b in pairs:
        ours = topo.path(a, b)
        reference = nx.shortest_path(g, f"dev:{a}", f"dev:{b}", weight="delay")
        ref_links = [g.edges[u, v]["link"] for u, v in itertools.pairwise(reference)]
        assert [lid for lid, _ in ours] == ref_links
        ref_delay = nx.shortest_path_length(g, f"dev:{a}", f"dev:{b}", weight="delay")
        assert topo.path_latency(a, b) == pytest.approx(ref_delay)


def test_path_levels(selene: ClusterSpec) -> None:
    topo = Topology(selene)
    assert topo.path(3, 3) == ()
    assert [topo.links[lid].kind for lid, _ in topo.path(0, 7)] == ["device", "device"]
    kinds = [topo.links[lid].kind for lid, _ in topo.path(0, 8)]
    assert kinds == ["device", "node", "node", "device"]
    # Directions: out of the sender, into the receiver.
    assert topo.path(0, 8)[0][1] == 1 and topo.path(0, 8)[-1][1] == -1


def test_inter_dc_delay_is_five_us_per_km(nsfnet: ClusterSpec) -> None:
    topo = Topology(nsfnet)
    a = 0  # dc-a at site 1
    b = 256  # dc-b at site 5
    km = sum(topo.links[lid].km for lid, _ in topo.path(a, b))
    # Shortest NSFNET route 1-2-4-5 = 1050 + 750 + 600 km.
    assert km == 2400
    inter = sum(topo.links[lid].latency_s for lid, _ in topo.path(a, b) if topo.links[lid].km)
    assert inter == pytest.approx(2400 * 5e-6)


def test_slot_capacity_follows_reach(nsfnet: ClusterSpec) -> None:
    topo = Topology(nsfnet)
    by_km = {link.km: link.bandwidth_Bps * 8 / 1e9 for link in topo.links if link.kind == "interdc"}
    assert by_km[300] == pytest.approx(80 * 50)  # 16QAM
    assert by_km[1050] == pytest.approx(80 * 37.5)  # 8QAM
    assert by_km[1800] == pytest.approx(80 * 25)  # QPSK
    assert by_km[2400] == pytest.approx(80 * 12.5)  # BPSK
    assert choose_modulation(626).name == "8QAM"


def test_disconnected_datacenter_is_rejected(nsfnet: ClusterSpec) -> None:
    data = nsfnet.model_dump()
    data["links"] = [link for link in data["links"] if "13" not in (link["a"], link["b"])]
    with pytest.raises(ValueError, match="not connected"):
        Topology(ClusterSpec.model_validate(data))
