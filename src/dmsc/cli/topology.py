"""``dmsc topology``: the optical topologies dmsc knows (``list``, ``show``) and generated ones
(``generate``: inter-datacenter graphs written as ``a,b,km`` files that ``--topology`` reads, and
intra-datacenter fabrics with the figures a cost model uses), each with a plot of its graph."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from dmsc.cli.app import console
from dmsc.cli.options import JsonOpt
from dmsc.cli.tables import FoldTable
from dmsc.spec import SpecError

topology_app = typer.Typer(help="Optical topologies: list, show, generate.", no_args_is_help=True)


def _figures(topo: Any) -> dict[str, Any]:
    import networkx as nx

    g = nx.Graph()
    for a, b, km in topo.links:
        g.add_edge(a, b, km=km)
    kms = [km for _, _, km in topo.links]
    degrees = [d for _, d in g.degree]
    connected = nx.is_connected(g)
    return {
        "name": topo.name,
        "source": topo.source,
        "nodes": g.number_of_nodes(),
        "links": g.number_of_edges(),
        "connected": connected,
        "degree_mean": sum(degrees) / len(degrees),
        "degree_max": max(degrees),
        "km_min": min(kms),
        "km_mean": math.fsum(kms) / len(kms),
        "km_max": max(kms),
        "km_total": math.fsum(kms),  # full-mesh: 59461.6, where sum() gives 59461.59999999999
        # the longest shortest route: what the modulation table must reach
        "km_diameter": max(max(d.values()) for _, d in nx.shortest_path_length(g, weight="km"))
        if connected
        else None,
    }


def _load(name: str) -> Any:
    from dmsc.sim.topologies import topology

    try:
        return topology(name)
    except ValueError as exc:
        raise SpecError("command line", "NAME", str(exc)) from None


@topology_app.command("list")
def list_topologies(as_json: JsonOpt = False) -> None:
    """The named topologies, with their size and source."""
    from dmsc.spec.topologies import TOPOLOGIES

    rows = [_figures(_load(name)) for name in TOPOLOGIES]
    if as_json:
        print(json.dumps(rows))
        return
    table = FoldTable(title="optical topologies (dmsc simulate --lightpaths --topology NAME)")
    for col in ("name", "nodes", "links", "km per link", "longest route km", "source"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"], str(r["nodes"]), str(r["links"]),
            f"{r['km_min']:g} .. {r['km_max']:g}", f"{r['km_diameter']:g}", r["source"],
        )  # fmt: skip
    console.print(table)


@topology_app.command()
def show(
    name: Annotated[str, typer.Argument(help="A named topology, or an a,b,km or cluster file.")],
    plot: Annotated[str | None, typer.Option(help="Draw the graph to this PNG.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """A topology's nodes, links and lengths."""
    from dmsc.cli.paths import check_output

    check_output(plot, "--plot", image=True)
    topo = _load(name)
    out = {**_figures(topo), "sites": list(topo.sites), "link_list": [list(x) for x in topo.links]}
    if plot:
        _plot_sites(topo, plot)
    if as_json:
        print(json.dumps(out))
        return
    console.print(
        f"{out['name']}: {out['nodes']} nodes, {out['links']} links, {out['km_min']:g} to "
        f"{out['km_max']:g} km per link (mean {out['km_mean']:.0f}), longest shortest route "
        f"{out['km_diameter']} km, mean degree {out['degree_mean']:.2f}\nsource: {out['source']}",
        highlight=False,
    )


@topology_app.command()
def generate(
    kind: Annotated[
        str,
        typer.Argument(
            help="full-mesh, star, ring, waxman, clustered (inter-DC); "
            "fat-tree, dragonfly, torus, hypercube (intra-DC fabrics)."
        ),
    ],
    sites: Annotated[int, typer.Option(help="Inter-DC: sites.")] = 12,
    seed: Annotated[int, typer.Option(help="Inter-DC: the random draws.")] = 0,
    side_km: Annotated[float, typer.Option(help="Inter-DC: side of the square, km.")] = 2000.0,
    alpha: Annotated[float, typer.Option(help="Waxman alpha.")] = 0.4,
    beta: Annotated[float, typer.Option(help="Waxman beta.")] = 0.6,
    clusters: Annotated[int, typer.Option(help="Clustered: groups.")] = 3,
    k: Annotated[int, typer.Option("--k", help="Fat tree: ports per switch.")] = 4,
    a: Annotated[int, typer.Option("--a", help="Dragonfly: routers per group.")] = 4,
    p: Annotated[int, typer.Option("--p", help="Dragonfly: hosts per router.")] = 2,
    h: Annotated[int, typer.Option("--h", help="Dragonfly: global links per router.")] = 2,
    dims: Annotated[str, typer.Option(help="Torus: sizes, e.g. 4,4,4.")] = "4,4",
    d: Annotated[int, typer.Option("--d", help="Hypercube: dimensions.")] = 4,
    gbit_s: Annotated[float, typer.Option(help="Fabric: Gbit/s per link.")] = 400.0,
    out: Annotated[str | None, typer.Option(help="Inter-DC: write the a,b,km file.")] = None,
    plot: Annotated[str | None, typer.Option(help="Draw the graph to this PNG.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate an inter-DC graph (an a,b,km file for --topology) or an intra-DC fabric."""
    from dmsc.cli.paths import check_output
    from dmsc.sim import generators as gen

    check_output(plot, "--plot", image=True)
    check_output(out, "--out")
    try:
        if kind in gen.INTER_DC:
            g = gen.inter_dc(kind, sites, seed, side_km, alpha, beta, clusters)
        elif kind == "fat-tree":
            g = gen.fat_tree(k, gbit_s)
        elif kind == "dragonfly":
            g = gen.dragonfly(a, p, h, gbit_s=gbit_s)
        elif kind == "torus":
            sizes = [x.strip() for x in dims.split(",")]
            if not all(x.isdigit() for x in sizes):
                raise SpecError(
                    "command line", "--dims", f"expected sizes like 4,4,4, got {dims!r}"
                )
            g = gen.torus(tuple(int(x) for x in sizes), gbit_s)
        elif kind == "hypercube":
            g = gen.hypercube(d, gbit_s)
        else:
            raise ValueError(
                f"unknown kind {kind!r} (kinds: {', '.join((*gen.INTER_DC, *gen.FABRICS))})"
            )
    except ValueError as exc:
        raise SpecError("command line", "KIND", str(exc)) from None
    if kind in gen.INTER_DC:
        from dmsc.sim.topologies import from_links

        links = tuple((u, v, float(km)) for u, v, km in g.edges(data="km"))
        topo = from_links(f"{kind}-{sites}", links, f"dmsc topology generate {kind} --seed {seed}")
        result = _figures(topo)
        if out:
            rows = "".join(f"{u},{v},{km:g}\n" for u, v, km in links)
            Path(out).write_text(f"# {topo.source}\na,b,km\n{rows}")
        if plot:
            _plot_graph(g, plot, f"{kind}, {sites} sites", {v: g.nodes[v]["pos"] for v in g})
    else:
        result = {"kind": kind, **gen.fabric_figures(g)}
        if plot:
            _plot_graph(g, plot, kind, None)
    if as_json:
        print(json.dumps(result))
        return
    console.print(
        " ".join(f"{key}={_word(value)}" for key, value in result.items()), highlight=False
    )


def _word(value: Any) -> str:
    """A figure of ``topology generate`` as a person writes it: at most two decimals (not a
    float's noise: 2864.6000000000004), a text with spaces in quotes."""
    if isinstance(value, float):
        return str(round(value, 2)).removesuffix(".0")
    if isinstance(value, str) and " " in value:
        return f'"{value}"'
    return str(value)


def _plot_sites(topo: Any, path: str) -> None:
    import networkx as nx

    g = nx.Graph()
    for a, b, km in topo.links:
        g.add_edge(a, b, km=km)
    _plot_graph(g, path, topo.name, None, lengths=True)


def _plot_graph(g: Any, path: str, title: str, pos: Any, lengths: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    if pos is None:
        weight = "km" if lengths else None
        pos = nx.kamada_kawai_layout(g, weight=weight) if len(g) <= 300 else nx.spring_layout(g)
    fig, ax = plt.subplots(figsize=(7, 5.5))
    hosts = [v for v, r in g.nodes(data="role") if r == "host"]
    others = [v for v in g.nodes if v not in set(hosts)]
    nx.draw_networkx_edges(g, pos, ax=ax, alpha=0.5)
    nx.draw_networkx_nodes(g, pos, nodelist=others, node_size=120, ax=ax)
    if hosts:
        nx.draw_networkx_nodes(g, pos, nodelist=hosts, node_size=20, node_color="grey", ax=ax)
    if len(g) <= 60 and not hosts:
        nx.draw_networkx_labels(g, pos, font_size=7, ax=ax)
    if lengths and len(g) <= 30:
        labels = {(u, v): f"{km:g}" for u, v, km in g.edges(data="km")}
        nx.draw_networkx_edge_labels(g, pos, edge_labels=labels, font_size=6, ax=ax)
    ax.set_title(title)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
