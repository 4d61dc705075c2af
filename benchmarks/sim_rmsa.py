"""The optical layer alone: plain lightpath requests on NSFNET with k-shortest-path first-fit.

Blocking probability per load (Erlang) in the setting of DeepRMSA (Chen et al., JLT 2019) and
optical-rl-gym: the 14-node NSFNET of shared/validation/nsfnet.csv, 100 slots of 12.5 GHz per
fiber, k = 5 shortest routes, modulation by route length, requests of 25/50/75/100 Gbit/s between
uniform node pairs, first-fit and best-fit; and on a single link with one slot per request
against the Erlang-B closed form. Prints a table, or with --json one object.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

from dmsc.sim.network import OpticalNetwork
from dmsc.sim.rmsa import erlang_b, simulate_lightpaths


def nsfnet(slots: int, k_paths: int) -> OpticalNetwork:
    text = resources.files("dmsc.data").joinpath("nsfnet.csv").read_text()
    rows = [line.split(",") for line in text.splitlines() if line[:1].isdigit()]
    ends = [(a, b) for a, b, _ in rows]
    kms = [float(km) for _, _, km in rows]
    sites = sorted({x for e in ends for x in e}, key=int)
    return OpticalNetwork(
        sites=sites,
        link_ends=ends,
        link_km=kms,
        n_slots=slots,
        slot_ghz=12.5,
        k_paths=k_paths,
        dc_names=[],
        dc_sites=[],
        gpus_total=[],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=30_000)
    args = parser.parse_args()
    curve = []
    for load in (100, 200, 300, 400, 500, 600):
        row: dict[str, float] = {"load": load}
        for fit in ("first", "best"):
            r = simulate_lightpaths(
                nsfnet(100, 5),
                load,
                args.requests,
                seed=1,
                gbit_s=(25.0, 50.0, 75.0, 100.0),
                fit=fit,
            )
            row[f"blocking_{fit}_fit"] = r.blocking
            row[f"slot_utilization_{fit}_fit"] = r.mean_slot_utilization
        curve.append(row)
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
    out = {"nsfnet_ksp": curve, "single_link_vs_erlang_b": single}
    if args.json:
        print(json.dumps(out))
        return
    print("NSFNET, 100 slots, k=5 shortest paths, 25-100 Gbit/s requests")
    for row in curve:
        print(
            f"  {row['load']:5.0f} Erlang: blocking first-fit {row['blocking_first_fit']:.4f}, "
            f"best-fit {row['blocking_best_fit']:.4f}; slot utilisation "
            f"{row['slot_utilization_first_fit'] * 100:.1f}%"
        )
    print("One link of 10 slots, one slot per request: simulated vs Erlang B")
    for row in single:
        print(f"  {row['load']:5.1f} Erlang: {row['blocking']:.4f} vs {row['erlang_b']:.4f}")


if __name__ == "__main__":
    main()
