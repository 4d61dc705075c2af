"""The multi-datacenter optical network of a simulation: sites, fibers, routes, GPU pools."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import networkx as nx

from dmsc.netmodel.optical import DMSC, ModulationTable
from dmsc.sim.spectrum import SpectrumGrid
from dmsc.spec import ClusterSpec

if TYPE_CHECKING:
    from dmsc.sim.scenario import ScenarioSpec


@dataclass(frozen=True)
class Route:
    """A candidate path between two sites."""

    links: tuple[int, ...]
    km: float
    gbit_s_per_slot: float  # by the modulation the path length allows

    @property
    def propagation_s(self) -> float:
        return self.km * 5e-6

    def slots_for(self, gbit_s: float) -> int:
        return max(1, math.ceil(gbit_s / self.gbit_s_per_slot - 1e-9))


@dataclass
class OpticalNetwork:
    """Fibers between sites with a slot grid, k shortest routes, and datacenter GPU pools."""

    sites: list[str]
    link_ends: list[tuple[str, str]]
    link_km: list[float]
    n_slots: int
    slot_ghz: float
    k_paths: int
    dc_names: list[str]
    dc_sites: list[str]
    gpus_total: list[int]
    gpus_free: list[int] = field(default_factory=list)
    modulations: ModulationTable = DMSC  # formats by reach (see dmsc.netmodel.optical)
    guard_band: int = 0  # slots held above every lightpath
    seed: int = 0  # random fit's draws
    grid: SpectrumGrid = field(init=False)
    _routes: dict[tuple[str, str], tuple[Route, ...]] = field(default_factory=dict)
    _graph: nx.Graph = field(init=False)

    def __post_init__(self) -> None:
        self.grid = SpectrumGrid(
            len(self.link_ends), self.n_slots, seed=self.seed, guard=self.guard_band
        )
        if not self.gpus_free:
            self.gpus_free = list(self.gpus_total)
        g = nx.Graph()
        g.add_nodes_from(self.sites)
        for i, ((a, b), km) in enumerate(zip(self.link_ends, self.link_km, strict=True)):
            g.add_edge(a, b, link=i, km=km)
        self._graph = g

    @classmethod
    def from_cluster(
        cls,
        cluster: ClusterSpec,
        k_paths: int = 3,
        slots: int | None = None,
        modulations: ModulationTable = DMSC,
        guard_band: int = 0,
        seed: int = 0,
    ) -> OpticalNetwork:
        """The inter-DC network of ``cluster`` (its links must be slot grids of one size), with
        ``slots`` frequency slots on every fiber instead of the cluster's when given."""
        slotted = [link for link in cluster.links if link.slots is not None]
        if not slotted or len(slotted) != len(cluster.links):
            raise ValueError("links: the simulator needs every inter-DC link as frequency slots")
        sizes = {link.slots for link in slotted}
        widths = {link.slot_ghz for link in slotted}
        if len(sizes) != 1 or len(widths) != 1:
            raise ValueError("links: the simulator needs one slot count and width on all fibers")
        sites = sorted(
            {x for link in slotted for x in (link.a, link.b)}
            | {dc.site_name for dc in cluster.datacenters}
        )
        gpus = [
            sum(g.count * cluster.node_types[g.type].devices for g in dc.nodes)
            for dc in cluster.datacenters
        ]
        return cls(
            sites=sites,
            link_ends=[(link.a, link.b) for link in slotted],
            link_km=[link.km for link in slotted],
            n_slots=slots if slots is not None else int(sizes.pop() or 0),
            slot_ghz=float(widths.pop()),
            k_paths=k_paths,
            dc_names=[dc.name for dc in cluster.datacenters],
            dc_sites=[dc.site_name for dc in cluster.datacenters],
            gpus_total=gpus,
            modulations=modulations,
            guard_band=guard_band,
            seed=seed,
        )

    @classmethod
    def for_scenario(
        cls, scenario: ScenarioSpec, cluster: ClusterSpec, slots: int | None = None
    ) -> OpticalNetwork:
        """The network of a training-job scenario, with its optical settings."""
        from dmsc.netmodel.optical import modulation_table

        return cls.from_cluster(
            cluster,
            scenario.k_paths,
            slots,
            modulation_table(scenario.modulations),
            scenario.guard_band,
            scenario.seed,
        )

    def routes(self, a: str, b: str) -> tuple[Route, ...]:
        """The k shortest simple paths from site ``a`` to ``b`` by length (cached), less those
        longer than every modulation format reaches."""
        key = (a, b)
        if key not in self._routes:
            out = []
            for nodes in itertools.islice(
                nx.shortest_simple_paths(self._graph, a, b, weight="km"), self.k_paths
            ):
                links = tuple(self._graph.edges[u, v]["link"] for u, v in itertools.pairwise(nodes))
                km = sum(self.link_km[i] for i in links)
                try:
                    rate = self.modulations.gbit_s_per_slot(km, self.slot_ghz)
                except ValueError:  # beyond every format's reach: not a route
                    continue
                out.append(Route(links, km, rate))
            self._routes[key] = tuple(out)
        return self._routes[key]

    def dc_routes(self, a: int, b: int) -> tuple[Route, ...]:
        return self.routes(self.dc_sites[a], self.dc_sites[b])

    def gpu_utilization(self) -> float:
        used = sum(t - f for t, f in zip(self.gpus_total, self.gpus_free, strict=True))
        return used / sum(self.gpus_total)
