"""The optical layer alone: plain lightpath requests on NSFNET with k-shortest-path first-fit.

Blocking probability per load (Erlang) for requests of 100/200/400 Gbit/s between uniform node
pairs, 80 slots of 12.5 GHz per fiber, k = 3 routes, modulation by path length; and on a single
link with one slot per request against the Erlang-B closed form. Prints a table, or with --json
one object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dmsc.sim.network import OpticalNetwork
from dmsc.sim.rmsa import simulate_lightpaths
from dmsc.spec import ClusterSpec, load_spec

ROOT = Path(__file__).resolve().parents[1]


def erlang_b(load: float, servers: int) -> float:
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=30_000)
    args = parser.parse_args()
    cluster = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "nsfnet-4dc.yaml")
    nsfnet = []
    for load in (50, 100, 150, 200, 300, 400):
        net = OpticalNetwork.from_cluster(cluster, k_paths=3)
        r = simulate_lightpaths(net, load, args.requests, seed=1)
        nsfnet.append(
            {"load": load, "blocking": r.blocking, "slot_utilization": r.mean_slot_utilization}
        )
    single = []
    for load in (5.0, 8.0, 10.0, 12.0):
        net = OpticalNetwork(
            sites=["a", "b"],
            link_ends=[("a", "b")],
            link_km=[100.0],
            n_slots=10,
            slot_ghz=12.5,
            k_paths=1,
            dc_names=[],
            dc_sites=[],
            gpus_total=[],
        )
        r = simulate_lightpaths(
            net, load, args.requests, seed=2, gbit_s=(12.5,), pairs=[("a", "b")]
        )
        single.append({"load": load, "blocking": r.blocking, "erlang_b": erlang_b(load, 10)})
    out = {"nsfnet_ksp_ff": nsfnet, "single_link_vs_erlang_b": single}
    if args.json:
        print(json.dumps(out))
        return
    print("NSFNET, k=3 shortest paths, first-fit, 80 slots, 100/200/400 Gbit/s requests")
    for row in nsfnet:
        print(
            f"  {row['load']:5.0f} Erlang: blocking {row['blocking']:.4f}, "
            f"slot utilisation {row['slot_utilization'] * 100:.1f}%"
        )
    print("One link of 10 slots, one slot per request: simulated vs Erlang B")
    for row in single:
        print(f"  {row['load']:5.1f} Erlang: {row['blocking']:.4f} vs {row['erlang_b']:.4f}")


if __name__ == "__main__":
    main()
