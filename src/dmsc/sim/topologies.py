"""Optical topologies for the simulator: a named one (:mod:`dmsc.spec.topologies`), or a file of
``a,b,km`` rows (CSV, as ``dmsc topology generate`` writes them), or a cluster spec whose
``links`` are its fibers; each can become an :class:`OpticalNetwork`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dmsc.netmodel.optical import DMSC, ModulationTable
from dmsc.sim.network import OpticalNetwork
from dmsc.spec.topologies import TOPOLOGIES, named_links, parse_links


@dataclass(frozen=True)
class Topology:
    """Sites and the fibers between them (both directions share one slot grid per fiber)."""

    name: str
    sites: tuple[str, ...]
    links: tuple[tuple[str, str, float], ...]  # (a, b, km)
    source: str

    def network(
        self,
        slots: int,
        k_paths: int,
        modulations: ModulationTable = DMSC,
        guard_band: int = 0,
        seed: int = 0,
    ) -> OpticalNetwork:
        """An optical network of this topology with ``slots`` 12.5 GHz slots per fiber."""
        return OpticalNetwork(
            sites=list(self.sites),
            link_ends=[(a, b) for a, b, _ in self.links],
            link_km=[km for _, _, km in self.links],
            n_slots=slots,
            slot_ghz=12.5,
            k_paths=k_paths,
            dc_names=[],
            dc_sites=[],
            gpus_total=[],
            modulations=modulations,
            guard_band=guard_band,
            seed=seed,
        )


def _sort_key(site: str) -> tuple[int, str]:
    return (int(site), "") if site.isdigit() else (1 << 30, site)


def from_links(name: str, links: tuple[tuple[str, str, float], ...], source: str) -> Topology:
    sites = tuple(sorted({x for a, b, _ in links for x in (a, b)}, key=_sort_key))
    return Topology(name, sites, links, source)


def _packaged(name: str) -> Topology:
    return from_links(name, named_links(name), TOPOLOGIES[name][1])


def topology(name_or_file: str) -> Topology:
    """A named topology, or the sites and slotted links of a cluster spec file (ValueError
    naming the known ones otherwise)."""
    if name_or_file in TOPOLOGIES:
        return _packaged(name_or_file)
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(
            f"{name_or_file!r} is neither a topology ({', '.join(TOPOLOGIES)}) nor a file"
        )
    if path.suffix == ".csv":
        return from_links(path.stem, parse_links(path.read_text(), str(path)), str(path))
    from dmsc.spec import ClusterSpec, load_spec

    cluster = load_spec(ClusterSpec, name_or_file)
    if not cluster.links:
        raise ValueError(f"{name_or_file}: the cluster has no inter-DC links")
    links = tuple((link.a, link.b, link.km) for link in cluster.links)
    sites = tuple(sorted({x for a, b, _ in links for x in (a, b)}))
    return Topology(Path(name_or_file).stem, sites, links, str(name_or_file))
