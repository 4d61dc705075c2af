"""The cluster as a network: devices, node fabrics, datacenter fabrics and inter-DC fibers.

Every link is full duplex: ``bandwidth_Bps`` is per direction. :meth:`Topology.path` gives the
links between two devices from the structure (device -> node fabric -> DC fabric -> inter-DC route
-> ...), in constant time per call; :attr:`Topology.graph` is the same network as a networkx graph,
built on first use, and inter-DC routes are its shortest paths by propagation delay.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import networkx as nx

from dmsc.netmodel.fabrics import dc_uplink
from dmsc.netmodel.optical import link_capacity_gbit_s
from dmsc.spec.cluster import ClusterSpec, CollectiveSpec, DeviceTypeSpec

LinkKind = Literal["device", "node", "interdc"]
Hop = tuple[int, int]  # (link id, direction): +1 from link.u to link.v, -1 the other way


# A node's measured collective (``dmsc calibrate``: ``collective.latency_us``) is one whole
# all-reduce call of two of its devices, idle. The cost model sums a latency per link crossed and
# per step: a ring of two devices takes two steps (reduce-scatter, all-gather), each a hop over
# both devices' links into the node, so a link carries a quarter of an idle call's latency...
CALL_LINK_LATENCIES = 4
# ... times what a call in a training step meets beyond an idle one, by backend. gloo: 3. On this
# project's 2-core machine the modes are measured by their exposed time (dmsc.data.comm_modes:
# call by call from the last member's entry to the last one's exit, without a peer's skew). A
# tp = 2 all-reduce of 512 KB in a step took 0.5-0.7 ms most times, against about 0.5 idle, and
# 2-10 ms a few times a step with both ranks inside the call (2026-12-05). Priced at 3, five
# runs' median of measured over predicted was 0.97 for the tp = 2 all-reduces, 1.20 for the
# expert-parallel all-to-alls of ep = 2 and 0.96 for the dp = 2 ring, each moving by 30-50% from
# run to run (parallel_modes_cpu.json: rerun_2026_12_05_exposed and rerun_2026_12_05_awake_dp
# at 4, scaled; reruns_2026_12_05_in_step_3). It was
# 4 while a rank's wait, its peer's skew included, stood for the call
# (experiment_2026_12_04_whole_call_latency: 3.6-4.5 for tp = 2). nccl: priced as measured, 1
# (the CUDA devices of a node do not share cores; no step of two GPUs has been measured here).
IN_STEP_CALL = {"gloo": 3.0, "nccl": 1.0}
# ... but the step's wait for its data-parallel buckets after the backward (gloo's own ring) is
# spun for up to 50 ms (dmsc.runtime.compute.waiting.DP_SPIN_S), not 4 ms and then blocked as
# the tensor- and expert-parallel calls are. Where each worker has a core of its own, its
# exposed last bucket met less than the tp calls' 3: a dp = 2 ring of gpt-mini exposed 2.6-2.7
# ms for a 3.4 MB bucket, which its idle awake call would take in about 2.4, and priced at 3
# it measured 0.71-1.20 of its price over eight rounds (median 0.82; parallel_modes_cpu.json:
# reruns_2026_12_05_final, _in_step_3, _shared_collective), moe-mini's dp = 2 all-reduce
# 0.52-0.91 (0.72). Re-predicted from each round's own calibration at the measured awake call
# times 1.5, 1.75, 2 and 2.25, those rounds came to 0.84-1.67 / 0.78-1.41 at 1.5 and
# 0.81-1.58 (median 0.95) / 0.72-1.23 (1.05) at 2, the most of them within 15% (10 of 16,
# 5 before); 2 is kept. Where the workers share cores the spinning wait takes a core from a
# peer that computes, and the call is priced as the others are (IN_STEP_CALL).
SPUN_CALL = {"gloo": 2.0, "nccl": 1.0}


def link_call_latency_s(
    collective: CollectiveSpec, awake: bool = False, spun: bool = False
) -> float | None:
    """The latency a device link of the node carries per step of a collective, from its
    measured one (``awake``: of calls waited for awake; ``spun``: of the data-parallel buckets
    the step spins for, at the awake figure; None where that was not measured)."""
    us = collective.latency_awake_us if awake or spun else collective.latency_us
    if us is None:
        return None
    factor = (SPUN_CALL if spun else IN_STEP_CALL)[collective.backend]
    return us * 1e-6 * factor / CALL_LINK_LATENCIES


@dataclass(frozen=True)
class Link:
    """One full-duplex link of the topology."""

    id: int
    u: str
    v: str
    kind: LinkKind
    bandwidth_Bps: float
    latency_s: float
    km: float = 0.0
    # a collective's figures where they were measured apart (a node's gloo or NCCL, the
    # cluster spec's node_types.*.collective); None: the link's
    collective_Bps: float | None = None
    collective_latency_s: float | None = None
    # the figures when the rank waits for the call awake (dmsc's tp and ep collectives), and
    # spinning on a core of its own (the data-parallel buckets: SPUN_CALL)
    collective_awake_Bps: float | None = None
    collective_latency_awake_s: float | None = None
    collective_latency_spun_s: float | None = None
    # the replicas' quorum before a whole exchange (dmsc.runtime.compute.quorum), measured
    collective_quorum_s: float | None = None


@dataclass(frozen=True)
class Device:
    """One accelerator: its global index, where it sits and its type."""

    index: int
    dc: int
    node: int
    local: int
    type_name: str
    link: int  # id of its link into the node fabric


@dataclass(frozen=True)
class NodeInfo:
    """One server of the cluster."""

    index: int
    dc: int
    type_name: str
    first_device: int
    devices: int
    uplink: int  # id of its link into the DC fabric


def _site(name: str) -> str:
    return f"site:{name}"


class Topology:
    """Devices, nodes, datacenters and links built from a :class:`ClusterSpec`."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.links: list[Link] = []
        self.devices: list[Device] = []
        self.nodes: list[NodeInfo] = []
        self.dc_names: list[str] = [dc.name for dc in cluster.datacenters]
        self.dc_sites: list[str] = [dc.site_name for dc in cluster.datacenters]
        for d, dc in enumerate(cluster.datacenters):
            fabric = _site(dc.site_name)
            uplink_gbit_s, uplink_us = dc_uplink(dc.network)
            for group in dc.nodes:
                ntype = cluster.node_types[group.type]
                for _ in range(group.count):
                    n = len(self.nodes)
                    uplink = self._add_link(
                        f"node:{n}",
                        fabric,
                        "node",
                        uplink_gbit_s,
                        uplink_us,
                    )
                    first = len(self.devices)
                    self.nodes.append(NodeInfo(n, d, group.type, first, ntype.devices, uplink))
                    for local in range(ntype.devices):
                        i = len(self.devices)
                        link = self._add_link(
                            f"dev:{i}",
                            f"node:{n}",
                            "device",
                            ntype.link.bandwidth_gbit_s,
                            ntype.link.latency_us,
                            collective=ntype.collective,
                        )
                        self.devices.append(Device(i, d, n, local, ntype.device, link))
        self._interdc: dict[frozenset[str], int] = {}
        for spec in cluster.links:
            link = self._add_link(
                _site(spec.a),
                _site(spec.b),
                "interdc",
                link_capacity_gbit_s(spec),
                spec.km * cluster.propagation_us_per_km,
                km=spec.km,
            )
            self._interdc[frozenset((spec.a, spec.b))] = link
        self._routes: dict[tuple[int, int], tuple[Hop, ...]] = {}
        self._check_connected()

    def _add_link(
        self,
        u: str,
        v: str,
        kind: LinkKind,
        gbit_s: float,
        latency_us: float,
        km: float = 0.0,
        collective: CollectiveSpec | None = None,
    ) -> int:
        link = Link(len(self.links), u, v, kind, gbit_s * 1e9 / 8, latency_us * 1e-6, km)
        if collective is not None:
            awake_bw, quorum = collective.bandwidth_awake_gbit_s, collective.quorum_us
            link = replace(
                link,
                collective_Bps=collective.bandwidth_gbit_s * 1e9 / 8,
                collective_latency_s=link_call_latency_s(collective),
                collective_awake_Bps=None if awake_bw is None else awake_bw * 1e9 / 8,
                collective_latency_awake_s=link_call_latency_s(collective, awake=True),
                collective_latency_spun_s=link_call_latency_s(collective, spun=True),
                collective_quorum_s=None if quorum is None else quorum * 1e-6,
            )
        self.links.append(link)
        return link.id

    @cached_property
    def site_graph(self) -> nx.Graph:
        """Sites (datacenters and transit nodes) joined by inter-DC links, weighted by delay."""
        g = nx.Graph()
        g.add_nodes_from(self.dc_sites)
        for link in self.links:
            if link.kind == "interdc":
                a, b = link.u.removeprefix("site:"), link.v.removeprefix("site:")
                g.add_edge(a, b, link=link.id, delay=link.latency_s, km=link.km)
        return g

    @cached_property
    def graph(self) -> nx.Graph:
        """The whole network, one graph node per device, node fabric and site."""
        g = nx.Graph()
        for link in self.links:
            g.add_edge(
                link.u,
                link.v,
                link=link.id,
                kind=link.kind,
                delay=link.latency_s,
                bandwidth_Bps=link.bandwidth_Bps,
            )
        return g

    def _check_connected(self) -> None:
        if len(self.dc_sites) > 1:
            sg = self.site_graph
            first = self.dc_sites[0]
            for name, site in zip(self.dc_names, self.dc_sites, strict=True):
                if not nx.has_path(sg, first, site):
                    raise ValueError(
                        f"links: datacenter {name!r} is not connected to {self.dc_names[0]!r}"
                    )

    def device_type(self, device: int) -> DeviceTypeSpec:
        return self.cluster.device_types[self.devices[device].type_name]

    def dc_route(self, a: int, b: int) -> tuple[Hop, ...]:
        """Inter-DC hops from datacenter ``a`` to ``b`` along the lowest-delay route (cached)."""
        key = (a, b)
        if key not in self._routes:
            sites = nx.shortest_path(self.site_graph, self.dc_sites[a], self.dc_sites[b], "delay")
            hops: list[Hop] = []
            for x, y in itertools.pairwise(sites):
                link = self.links[self._interdc[frozenset((x, y))]]
                hops.append((link.id, 1 if link.u == _site(x) else -1))
            self._routes[key] = tuple(hops)
        return self._routes[key]

    def path(self, a: int, b: int) -> tuple[Hop, ...]:
        """Directed links from device ``a`` to device ``b`` (empty when ``a == b``)."""
        if a == b:
            return ()
        da, db = self.devices[a], self.devices[b]
        if da.node == db.node:
            return ((da.link, 1), (db.link, -1))
        up, down = self.nodes[da.node].uplink, self.nodes[db.node].uplink
        if da.dc == db.dc:
            return ((da.link, 1), (up, 1), (down, -1), (db.link, -1))
        return ((da.link, 1), (up, 1), *self.dc_route(da.dc, db.dc), (down, -1), (db.link, -1))

    def path_latency(self, a: int, b: int) -> float:
        return sum(self.links[link].latency_s for link, _ in self.path(a, b))
