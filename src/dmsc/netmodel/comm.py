"""Collectives of many concurrent groups over a :class:`Topology`: time and traffic by link.

A collective step moves data along *hops* (device to device). Each hop follows the topology's path
and shares every link with the other hops of the same step (all groups of one parallelism mode run
their collective at the same time: every tensor-parallel group, every data-parallel ring). The
slowest hop sets the pace: its bandwidth is ``min over its links of bandwidth x efficiency / load``.
The closed forms of :mod:`dmsc.netmodel.collectives` then give the time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from dmsc.netmodel import collectives as cf
from dmsc.netmodel.constants import Calibration
from dmsc.netmodel.topology import Hop, Link, Topology

Group = tuple[int, ...]
_Split = tuple[tuple[Group, ...], tuple[Group, ...]]  # groups within domains, groups across


class PerHop(Mapping[int, float]):
    """Bytes on each link of a hop set: ``per_hop`` bytes times the hops that cross it, read
    when asked (a strategy search prices hundreds of calls over a thousand links each and reads
    the links of one strategy)."""

    def __init__(self, hops: Mapping[int, int], per_hop: float) -> None:
        self.hops = hops
        self.per_hop = per_hop

    def __getitem__(self, lid: int) -> float:
        return self.per_hop * self.hops[lid]

    def __iter__(self) -> Iterator[int]:
        return iter(self.hops)

    def __len__(self) -> int:
        return len(self.hops)

    def __repr__(self) -> str:
        return repr(dict(self.items()))


@dataclass(frozen=True)
class CommCost:
    """Time of one collective call and the bytes it puts on each link (both directions summed)."""

    time_s: float
    bytes_sent: float = 0.0
    link_bytes: Mapping[int, float] = field(default_factory=dict)

    def scaled(self, times: float) -> CommCost:
        """The same call made ``times`` times in a row."""
        links = self.link_bytes
        return CommCost(
            self.time_s * times,
            self.bytes_sent * times,
            PerHop(links.hops, links.per_hop * times)
            if isinstance(links, PerHop)
            else {k: v * times for k, v in links.items()},
        )


ZERO_COST = CommCost(0.0)


@dataclass(frozen=True)
class _HopSet:
    """Concurrent hops: how fast the slowest goes and how often each link is crossed."""

    inv_bw: float  # seconds per byte on the slowest hop
    alpha: float  # latency of the slowest hop
    link_hops: dict[int, int]  # link id -> hops crossing it (any direction)


def _efficiency(kind: str, calib: Calibration) -> float:
    if kind == "device":
        return calib.intra_node_link_efficiency
    if kind == "node":
        return calib.network_link_efficiency
    return calib.inter_dc_link_efficiency


Wait = Literal["blocked", "awake", "spun"]  # how the ranks wait for a collective's calls


def _latency(link: Link, collective: bool, wait: Wait = "blocked") -> float:
    if collective and wait == "spun" and link.collective_latency_spun_s is not None:
        return link.collective_latency_spun_s
    if collective and wait != "blocked" and link.collective_latency_awake_s is not None:
        return link.collective_latency_awake_s
    if collective and link.collective_latency_s is not None:
        return link.collective_latency_s
    return link.latency_s


class CommModel:
    """Costs collectives over one topology; caches hop sets, which do not depend on sizes."""

    def __init__(self, topo: Topology, calib: Calibration, wait: Wait = "blocked") -> None:
        self.topo = topo
        self.calib = calib
        self.wait = wait  # how the ranks wait for the collectives (awake_view, spun_view)
        self._views: dict[Wait, CommModel] = {}
        self._cache: dict[tuple[str, tuple[Group, ...]], _HopSet] = {}
        # groups cut by node or datacenter (hierarchical all-reduce): by (groups, level)
        self._domains: dict[tuple[tuple[Group, ...], str], _Split | None] = {}

    def _hopset(self, pairs: Sequence[tuple[int, int]], collective: bool) -> _HopSet:
        """The hops of ``pairs``; a ``collective``'s at a link's measured collective figures
        where it has them (:attr:`Link.collective_Bps`)."""
        paths = [self.topo.path(a, b) for a, b in pairs if a != b]
        load: Counter[Hop] = Counter()
        for path in paths:
            load.update(path)
        links = self.topo.links
        inv_bw = 0.0
        alpha = 0.0
        link_hops: Counter[int] = Counter()
        for (lid, _), count in load.items():
            link = links[lid]
            eff = _efficiency(link.kind, self.calib)
            bw = link.collective_Bps if collective and link.collective_Bps else link.bandwidth_Bps
            if collective and self.wait != "blocked" and link.collective_awake_Bps:
                bw = link.collective_awake_Bps
            inv_bw = max(inv_bw, count / (bw * eff))
            link_hops[lid] += count
        for path in paths:
            alpha = max(alpha, sum(_latency(links[lid], collective, self.wait) for lid, _ in path))
        return _HopSet(inv_bw, alpha, dict(link_hops))

    def awake_view(self) -> CommModel:
        """This model for collectives the ranks wait for awake (dmsc's tensor- and
        expert-parallel calls, :mod:`dmsc.runtime.compute.waiting`): a collective's latency is
        the measured awake one where the spec has it (``collective.latency_awake_us``, and
        ``bandwidth_awake_gbit_s``); itself where no link has them."""
        return self._view("awake")

    def spun_view(self) -> CommModel:
        """This model for the data-parallel buckets the step spins for on a core of its own
        (:data:`dmsc.netmodel.topology.SPUN_CALL`): the measured awake figures, the latency at
        the spun factor; itself where no link has them."""
        return self._view("spun")

    def _view(self, wait: Wait) -> CommModel:
        if self.wait == wait:
            return self
        if wait not in self._views:
            measured = any(
                link.collective_latency_awake_s is not None or link.collective_awake_Bps
                for link in self.topo.links
            )
            self._views[wait] = CommModel(self.topo, self.calib, wait) if measured else self
        return self._views[wait]

    def quorum_s(self, groups: Sequence[Group]) -> float:
        """The replicas' quorum before one exchange of ``groups`` that dmsc's runtime runs whole
        (:mod:`dmsc.runtime.compute.quorum`: the store round trips every replica waits for):
        the slowest group's, each the measured figure of the links its members reach each other
        by (``collective.quorum_us``); 0 where none is measured or a group is one replica."""
        out = 0.0
        links = self.topo.links
        for g in groups:
            for a in g[1:]:
                for lid, _ in self.topo.path(g[0], a):
                    out = max(out, links[lid].collective_quorum_s or 0.0)
        return out

    def _pattern(self, name: str, groups: tuple[Group, ...]) -> _HopSet:
        key = (name, groups)
        if key not in self._cache:
            pairs: list[tuple[int, int]] = []
            for g in groups:
                n = len(g)
                if name == "ring":
                    pairs.extend((g[i], g[(i + 1) % n]) for i in range(n))
                elif name == "tree":
                    pairs.extend((g[(i - 1) // 2], g[i]) for i in range(1, n))
                elif name == "pairs":
                    pairs.extend((a, b) for a in g for b in g if a != b)
                else:  # "p2p": each group is (source, destination)
                    pairs.append((g[0], g[1]))
            self._cache[key] = self._hopset(pairs, collective=name != "p2p")
        return self._cache[key]

    def _cost(self, hs: _HopSet, time_s: float, per_hop_bytes: float, sent: float) -> CommCost:
        return CommCost(
            time_s + self.calib.collective_overhead_s,
            sent,
            PerHop(hs.link_hops, per_hop_bytes),
        )

    def p2p(self, flows: Sequence[tuple[int, int]], nbytes: float) -> CommCost:
        """``nbytes`` from each source to its destination, all flows at once."""
        flows = tuple((a, b) for a, b in flows if a != b)
        if not flows or nbytes <= 0:
            return ZERO_COST
        hs = self._pattern("p2p", flows)
        t = cf.p2p_time(nbytes, 1.0 / hs.inv_bw, hs.alpha)
        return self._cost(hs, t, nbytes, nbytes * len(flows))

    def star(self, groups: Sequence[Group], up_bytes: float, down_bytes: float) -> CommCost:
        """Every member of each group but the first sends ``up_bytes`` to the first (its
        leader), all at once, then the leader sends ``down_bytes`` back to each: the leader's
        link carries ``n - 1`` payloads each way, at the data plane's figures (a leader's
        sends are point-to-point, not a collective library's)."""
        up = [(m, g[0]) for g in groups for m in g[1:] if m != g[0]]
        down = [(b, a) for a, b in up]
        gather, back = self.p2p(up, up_bytes), self.p2p(down, down_bytes)
        links = dict(gather.link_bytes.items())
        for k, v in back.link_bytes.items():
            links[k] = links.get(k, 0.0) + v
        sent = gather.bytes_sent + back.bytes_sent
        return CommCost(gather.time_s + back.time_s, sent, links)

    def collective(
        self,
        kind: cf.CollectiveKind,
        groups: Sequence[Group],
        nbytes: float,
        algorithm: str = "auto",
    ) -> CommCost:
        """One call of ``kind`` in every group at once; ``nbytes`` is the full buffer size."""
        groups = tuple(tuple(g) for g in groups if len(g) > 1)
        if not groups or nbytes <= 0:
            return ZERO_COST
        n = max(len(g) for g in groups)
        if kind == "all_reduce":
            return self._all_reduce(groups, n, nbytes, algorithm)
        if kind == "p2p":
            return self.p2p([(g[0], g[1]) for g in groups], nbytes)
        pattern = "pairs" if kind in ("all_to_all", "scatter", "gather") else "ring"
        hs = self._pattern(pattern, groups)
        t = cf.ring_time(kind, n, nbytes, 1.0 / hs.inv_bw, hs.alpha)
        sent = cf.bytes_sent_per_rank(kind, n, nbytes) * sum(len(g) for g in groups)
        hops = sum(len(g) * (len(g) - 1) if pattern == "pairs" else len(g) for g in groups)
        return self._cost(hs, t, sent / hops, sent)

    def all_reduce_choice(
        self, groups: Sequence[Group], nbytes: float, algorithm: str = "auto"
    ) -> str:
        """The algorithm ``algorithm`` comes to for one all-reduce of ``nbytes`` in every group
        at once: itself, but ``auto`` the fastest of the three and ``hierarchical`` the ring
        where the groups do not split into equal domains (what a runtime should run); the ring
        when there is nothing to reduce."""
        groups = tuple(tuple(g) for g in groups if len(g) > 1)
        if not groups or nbytes <= 0:
            return "ring"
        n = max(len(g) for g in groups)
        options = self._all_reduce_options(groups, n, nbytes, algorithm)
        return min(options, key=lambda o: o[1].time_s)[0]

    def _all_reduce(
        self, groups: tuple[Group, ...], n: int, nbytes: float, algorithm: str
    ) -> CommCost:
        options = self._all_reduce_options(groups, n, nbytes, algorithm)
        return min((c for _, c in options), key=lambda c: c.time_s)

    def _all_reduce_options(
        self, groups: tuple[Group, ...], n: int, nbytes: float, algorithm: str
    ) -> list[tuple[str, CommCost]]:
        options: list[tuple[str, CommCost]] = []
        sent = 2 * (n - 1) / n * nbytes * sum(len(g) for g in groups)
        if algorithm in ("auto", "ring"):
            hs = self._pattern("ring", groups)
            t = cf.ring_time("all_reduce", n, nbytes, 1.0 / hs.inv_bw, hs.alpha)
            options.append(("ring", self._cost(hs, t, sent / sum(len(g) for g in groups), sent)))
        if algorithm in ("auto", "tree"):
            hs = self._pattern("tree", groups)
            t = cf.tree_all_reduce_time(n, nbytes, 1.0 / hs.inv_bw, hs.alpha)
            tree_sent = 2 * nbytes * sum(len(g) - 1 for g in groups)
            options.append(("tree", self._cost(hs, t, 2 * nbytes, tree_sent)))
        if algorithm in ("auto", "hierarchical"):
            hier = [
                ("hierarchical", c)
                for c in (
                    self._hierarchical(groups, nbytes, "node"),
                    self._hierarchical(groups, nbytes, "dc"),
                )
                if c is not None
            ]
            if hier:
                options.extend(hier)
            elif algorithm == "hierarchical":
                hs = self._pattern("ring", groups)
                t = cf.ring_time("all_reduce", n, nbytes, 1.0 / hs.inv_bw, hs.alpha)
                ring = self._cost(hs, t, sent / sum(len(g) for g in groups), sent)
                options.append(("ring", ring))
        return options

    def _split(self, groups: tuple[Group, ...], level: str) -> _Split | None:
        """Each group's members by node (or datacenter), and one member of each domain per
        cross-domain group; ``None`` unless every domain of every group has the same number of
        members, more than one, in more than one domain. Cached: a search asks for the same
        groups many times."""
        key = (groups, level)
        if key in self._domains:
            return self._domains[key]
        devices = self.topo.devices
        local_groups: list[Group] = []
        cross_groups: list[Group] = []
        out: _Split | None = None
        for g in groups:
            by_domain: dict[int, list[int]] = {}
            for d in g:
                domain = devices[d].node if level == "node" else devices[d].dc
                by_domain.setdefault(domain, []).append(d)
            sizes = {len(v) for v in by_domain.values()}
            if len(sizes) != 1 or len(by_domain) < 2 or sizes == {1}:
                break
            members = list(by_domain.values())
            local_groups.extend(tuple(m) for m in members)
            per_domain = len(members[0])
            cross_groups.extend(tuple(m[i] for m in members) for i in range(per_domain))
        else:
            out = (tuple(local_groups), tuple(cross_groups))
        self._domains[key] = out
        return out

    def _hierarchical(
        self, groups: tuple[Group, ...], nbytes: float, level: str
    ) -> CommCost | None:
        """Reduce-scatter inside each node (or datacenter), all-reduce across them, all-gather.

        The all-reduce across domains is itself costed with every algorithm (so across
        datacenters, the part inside each datacenter may be hierarchical by node again). Applies
        when every group has the same number of members in each of its domains, more than one
        member per domain and more than one domain; else ``None`` (it would be the flat ring).
        """
        split = self._split(groups, level)
        if split is None:
            return None
        local, cross = split
        g_local = len(local[0])
        rs = self.collective("reduce_scatter", local, nbytes)
        ar = self._all_reduce(cross, len(cross[0]), nbytes / g_local, "auto")
        ag = self.collective("all_gather", local, nbytes)
        links: Counter[int] = Counter()
        for part in (rs, ar, ag):
            links.update(part.link_bytes)
        return CommCost(
            rs.time_s + ar.time_s + ag.time_s,
            rs.bytes_sent + ar.bytes_sent + ag.bytes_sent,
            dict(links),
        )
