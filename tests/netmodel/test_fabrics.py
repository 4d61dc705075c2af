"""Datacenter fabrics: the cost model's closed forms against the built graph (max flow and
diameter by networkx), and a fabric's effect on a node's uplink in the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.netmodel import fabrics
from dmsc.netmodel.topology import Topology
from dmsc.spec import ClusterSpec, SpecError, load_spec
from dmsc.spec.cluster import DCNetworkSpec, FabricSpec

CASES = [
    (FabricSpec(kind="fat-tree", k=6, gbit_s=100), lambda: fabrics.fat_tree(6, 100)),
    (FabricSpec(kind="torus", dims=[3, 6], gbit_s=100), lambda: fabrics.torus((3, 6), 100)),
    (FabricSpec(kind="hypercube", d=4, gbit_s=100), lambda: fabrics.hypercube(4, 100)),
    (FabricSpec(kind="dragonfly", a=3, p=2, h=1), lambda: fabrics.dragonfly(3, 2, 1)),
    (FabricSpec(kind="dragonfly", a=4, p=3, h=2, groups=6), lambda: fabrics.dragonfly(4, 3, 2, 6)),
]


@pytest.mark.parametrize(("spec", "build"), CASES)
def test_closed_forms_match_the_graph(spec: FabricSpec, build: object) -> None:
    want = fabrics.fabric_figures(build())  # type: ignore[operator]
    got = fabrics.summary(spec)
    assert got["hosts"] == want["hosts"] == spec.hosts
    assert got["diameter_hops"] == want["diameter_hops"]
    assert got["bisection_gbit_s_per_host"] == pytest.approx(want["bisection_gbit_s_per_host"])


def test_an_oversubscribed_fabric_lowers_a_nodes_uplink() -> None:
    fabric = FabricSpec(kind="dragonfly", a=4, p=2, h=2, hop_latency_us=0.5)
    net = DCNetworkSpec(gbit_s_per_node=400, latency_us=2.0, fabric=fabric)
    gbit_s, latency = fabrics.dc_uplink(net)
    # 9 groups of 8 hosts, one global link per pair: 4 x 5 = 20 links of 400 across 36 hosts
    assert gbit_s == pytest.approx(20 * 400 / 36)
    assert latency == pytest.approx(2.0 + 5 * 0.5)
    plain = DCNetworkSpec(gbit_s_per_node=100, fabric=FabricSpec(kind="fat-tree", k=4))
    assert fabrics.dc_uplink(plain)[0] == 100  # the node's own uplink is lower


def test_the_cost_model_uses_the_fabric_and_the_spec_checks_its_size(tmp_path: Path) -> None:
    base = (
        "device_types: {gpu: {peak_tflops: {bf16: 100}, memory_gib: 40, memory_bw_gbyte_s: 1000}}\n"
        "node_types: {box: {device: gpu, devices: 4, link: {bandwidth_gbit_s: 800}}}\n"
        "datacenters:\n  - {name: a, nodes: [{type: box, count: 16}], network: "
        "{gbit_s_per_node: 400, latency_us: 2, fabric: FABRIC}}\n"
    )
    f = tmp_path / "c.yaml"
    f.write_text(base.replace("FABRIC", "{kind: torus, dims: [4, 4], gbit_s: 100}"))
    topo = Topology(load_spec(ClusterSpec, f))
    uplink = topo.links[topo.nodes[0].uplink]
    assert uplink.bandwidth_Bps == pytest.approx(100e9 / 8)  # 2 x 4 links of 100 / 8 hosts
    assert uplink.latency_s == pytest.approx((2 + 6 * 0.5) * 1e-6)
    f.write_text(base.replace("FABRIC", "{kind: hypercube, d: 3}"))
    with pytest.raises(SpecError, match=r"network.fabric: a hypercube of 8 hosts for 16 nodes"):
        load_spec(ClusterSpec, f)
    f.write_text(base.replace("FABRIC", "{kind: fat-tree, k: 5}"))
    with pytest.raises(SpecError, match="even k"):
        load_spec(ClusterSpec, f)
