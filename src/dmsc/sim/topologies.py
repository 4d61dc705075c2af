"""Optical topologies by name, as the RMSA literature uses them.

- ``nsfnet``: NSFNET, 14 nodes and 22 fibers with their lengths in km, the variant of DeepRMSA
  (Chen et al., JLT 2019) and optical-rl-gym (``dmsc/data/nsfnet.csv``).

A topology may also be a cluster spec file whose ``links`` are slot grids (its sites and fibers).
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


def _nsfnet() -> Topology:
    text = resources.files("dmsc.data").joinpath("nsfnet.csv").read_text()
    rows = [line.split(",") for line in text.splitlines() if line[:1].isdigit()]
    links = tuple((a, b, float(km)) for a, b, km in rows)
    sites = tuple(sorted({x for a, b, _ in links for x in (a, b)}, key=int))
    return Topology("nsfnet", sites, links, "DeepRMSA (Chen et al., JLT 2019), optical-rl-gym")


TOPOLOGIES = {"nsfnet": _nsfnet}


def topology(name_or_file: str) -> Topology:
    """A named topology, or the sites and slotted links of a cluster spec file (ValueError
    naming the known ones otherwise)."""
    if name_or_file in TOPOLOGIES:
        return TOPOLOGIES[name_or_file]()
    if not Path(name_or_file).is_file():
        raise ValueError(
            f"{name_or_file!r} is neither a topology ({', '.join(TOPOLOGIES)}) nor a file"
        )
    from dmsc.spec import ClusterSpec, load_spec

    cluster = load_spec(ClusterSpec, name_or_file)
    if not cluster.links:
        raise ValueError(f"{name_or_file}: the cluster has no inter-DC links")
    links = tuple((link.a, link.b, link.km) for link in cluster.links)
    sites = tuple(sorted({x for a, b, _ in links for x in (a, b)}))
    return Topology(Path(name_or_file).stem, sites, links, str(name_or_file))
