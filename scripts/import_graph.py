"""Print the import graph between dmsc's packages (and the runtime's sub-packages) and its cycles.

    python scripts/import_graph.py [--json]

Edges come from grimp (the import-graph library behind import-linter), cycles from networkx.
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
    args = parser.parse_args()
    graph = grimp.build_graph("dmsc")
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


if __name__ == "__main__":
    main()
