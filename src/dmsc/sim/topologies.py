"""Optical topologies by name, as the RMSA literature uses them.

- ``nsfnet``: NSFNET, 14 nodes and 22 fibers with their lengths in km, the variant of DeepRMSA
  (Chen et al., JLT 2019) and optical-rl-gym;
- ``cost239``: the pan-European COST239 network, 11 nodes, 26 links;
- ``usnet``: USNET (US24), 24 nodes, 43 links;
- ``jpn12``: the Japanese JPN12 network, 12 nodes, 17 links;
- ``germany50``: SNDlib's germany50, 50 nodes, 88 links, lengths the great-circle distances
  between its nodes' coordinates (not fiber routes).

Each file under ``dmsc/data`` says in its header where its figures come from (the repository,
path and commit), and the doubts: these networks' link lengths differ between publications.

A topology may also be a file: ``a,b,km`` rows (CSV, as ``dmsc topology generate`` writes them),
or a cluster spec whose ``links`` are its fibers.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dmsc.netmodel.optical import DMSC, ModulationTable
from dmsc.sim.network import OpticalNetwork


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


def parse_links(text: str, where: str) -> tuple[tuple[str, str, float], ...]:
    """``a,b,km`` rows (a header row and ``#`` comments skipped); ValueError naming the line."""
    links = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#") or line.replace(" ", "") == "a,b,km":
            continue
        parts = [x.strip() for x in line.split(",")]
        try:
            a, b, km = parts[0], parts[1], float(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"{where}: line {n}: expected a,b,km, got {line!r}") from None
        if len(parts) != 3 or not a or not b or a == b or not km > 0:
            raise ValueError(f"{where}: line {n}: two different sites and a positive km")
        links.append((a, b, km))
    if not links:
        raise ValueError(f"{where}: no links")
    return tuple(links)


def _sort_key(site: str) -> tuple[int, str]:
    return (int(site), "") if site.isdigit() else (1 << 30, site)


def from_links(name: str, links: tuple[tuple[str, str, float], ...], source: str) -> Topology:
    sites = tuple(sorted({x for a, b, _ in links for x in (a, b)}, key=_sort_key))
    return Topology(name, sites, links, source)


def _packaged(name: str) -> Topology:
    filename, source = TOPOLOGIES[name]
    text = resources.files("dmsc.data").joinpath(filename).read_text()
    return from_links(name, parse_links(text, filename), source)


# name -> (file under dmsc/data, where its figures come from)
TOPOLOGIES: dict[str, tuple[str, str]] = {
    "nsfnet": ("nsfnet.csv", "NSFNET as DeepRMSA (Chen et al., JLT 2019) and optical-rl-gym use"),
    "cost239": ("cost239.csv", "COST239 pan-European, lengths published with PtrNet-RSA (XLRON)"),
    "usnet": ("usnet.csv", "USNET/US24, 24 nodes 43 links (pivote1214/optical-network; XLRON)"),
    "jpn12": ("jpn12.csv", "JPN12 Japan, 12 nodes 17 links (pivote1214/optical-network)"),
    "germany50": ("germany50.csv", "SNDlib germany50, great-circle km from its coordinates"),
}


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
