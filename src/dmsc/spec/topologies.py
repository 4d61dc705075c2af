"""Optical topologies by name, as the RMSA literature uses them: sites and fibers with lengths.

- ``nsfnet``: NSFNET, 14 nodes and 22 fibers, the variant of DeepRMSA (Chen et al., JLT 2019)
  and optical-rl-gym;
- ``cost239``: the pan-European COST239 network, 11 nodes, 26 links;
- ``usnet``: USNET (US24), 24 nodes, 43 links;
- ``jpn12``: the Japanese JPN12 network, 12 nodes, 17 links;
- ``germany50``: SNDlib's germany50, 50 nodes, 88 links, lengths the great-circle distances
  between its nodes' coordinates (not fiber routes).

Each file under ``topology_files/`` says in its header where its figures come from (repository,
path and commit) and the doubts: these networks' link lengths differ between publications. A
cluster spec uses one by name (``topology:``), ``dmsc simulate --lightpaths --topology`` too.
"""

from __future__ import annotations

from importlib import resources

Links = tuple[tuple[str, str, float], ...]  # (site a, site b, km)

# name -> (file under topology_files, where its figures come from)
TOPOLOGIES: dict[str, tuple[str, str]] = {
    "nsfnet": ("nsfnet.csv", "NSFNET as DeepRMSA (Chen et al., JLT 2019) and optical-rl-gym use"),
    "cost239": ("cost239.csv", "COST239 pan-European, lengths published with PtrNet-RSA (XLRON)"),
    "usnet": ("usnet.csv", "USNET/US24, 24 nodes 43 links (pivote1214/optical-network; XLRON)"),
    "jpn12": ("jpn12.csv", "JPN12 Japan, 12 nodes 17 links (pivote1214/optical-network)"),
    "germany50": ("germany50.csv", "SNDlib germany50, great-circle km from its coordinates"),
}


def parse_links(text: str, where: str) -> Links:
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


def named_links(name: str) -> Links:
    """The fibers of a named topology (ValueError naming the known ones otherwise)."""
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r} (known: {', '.join(TOPOLOGIES)})")
    filename = TOPOLOGIES[name][0]
    text = resources.files("dmsc.spec").joinpath("topology_files", filename).read_text()
    return parse_links(text, filename)
