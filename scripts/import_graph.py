"""Print the import graph between dmsc's packages (and the runtime's sub-packages) and its cycles.

    python scripts/import_graph.py [--json] [--levels PACKAGE]

Edges come from grimp (the import-graph library behind import-linter), cycles from networkx.
``--levels PACKAGE`` prints instead the longest chain of direct imports between the modules of
PACKAGE (``dmsc.runtime``, ``dmsc.runtime.control``, ...): how many levels a reader goes down
from its top module to its bottom one.
"""

from __future__ import annotations

import argparse
import json

import grimp
import networkx as nx

UNITS = [
    "dmsc.spec",
    "dmsc.netmodel",
    "dmsc.planner",
    "dmsc.sim",
    "dmsc.data",
    "dmsc.runtime.transport",
    "dmsc.runtime.business",
    "dmsc.runtime.compute",
    "dmsc.runtime.control",
    "dmsc.cli",
]


def unit_of(module: str) -> str | None:
    for unit in UNITS:
        if module == unit or module.startswith(unit + "."):
            return unit
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--levels", metavar="PACKAGE", help="the longest import chain inside it")
    args = parser.parse_args()
    graph = grimp.build_graph("dmsc")
    if args.levels:
        print_levels(graph, args.levels, args.json)
        return
    edges: dict[tuple[str, str], int] = {}
    for module in graph.modules:
        a = unit_of(module)
        for imported in graph.find_modules_directly_imported_by(module):
            b = unit_of(imported)
            if a and b and a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1
    g = nx.DiGraph(list(edges))
    cycles = [list(c) for c in nx.simple_cycles(g)]
    if args.json:
        print(
            json.dumps(
                {"edges": [[a, b, n] for (a, b), n in sorted(edges.items())], "cycles": cycles}
            )
        )
        return
    for (a, b), n in sorted(edges.items()):
        print(f"{a:24} -> {b:24} {n:3} imports")
    print("cycles:", cycles or "none")


def print_levels(graph: grimp.ImportGraph, package: str, as_json: bool) -> None:
    """The longest chain of direct imports between modules of ``package`` (cycles, if any,
    counted as one level: networkx's condensation)."""
    inside = sorted(m for m in graph.modules if m.startswith(package + "."))
    g = nx.DiGraph()
    g.add_nodes_from(inside)
    for module in inside:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith(package + "."):
                g.add_edge(module, imported)
    dag = nx.condensation(g)
    chain = [sorted(dag.nodes[n]["members"])[0] for n in nx.dag_longest_path(dag)]
    if as_json:
        print(json.dumps({"package": package, "modules": len(inside), "chain": chain}))
        return
    print(f"{package}: {len(inside)} modules; the longest import chain has {len(chain)} levels:")
    print(" -> ".join(m[len(package) + 1 :] for m in chain))


if __name__ == "__main__":
    main()
