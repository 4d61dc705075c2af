"""The optical layer alone: lightpath requests on NSFNET in DeepRMSA's reference setting.

Blocking per load (Erlang) as the RMSA literature reports it (DeepRMSA, Chen et al., JLT 2019, as
implemented by optical-rl-gym): NSFNET (``dmsc topology show nsfnet``), 100 slots of 12.5 GHz per
fiber, k = 5 shortest routes, one guard-band slot, optical-rl-gym's modulation table, bit rates
uniform in 25..100 Gbit/s, KSP first fit (and best fit), 10,000 warm-up requests then 30,000
counted, 3 seeds, 95% intervals; the same without the guard band and with dmsc's table (the
setting before issue 16); one link with one slot per request against Erlang B.

Speed: the time per request at 200 Erlang, of dmsc's bit-mask spectrum search and, side by side
in the same run, of a numpy version of the same KSP first fit (the boolean AND of the route's
link rows, then a scan for a free run: dmsc's first implementation). optical-rl-gym's KSP-FF
takes about 2.6 ms per request on this machine (the issue's figure; it is not installed here).

Prints a table, or with --json one object.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import time
from typing import Any

import numpy as np

from dmsc.netmodel.optical import DMSC, OPTICAL_RL_GYM
from dmsc.sim.metrics import mean_ci
from dmsc.sim.network import OpticalNetwork
from dmsc.sim.rmsa import BitRates, erlang_b, simulate_lightpaths
from dmsc.sim.topologies import topology

RATES = BitRates(uniform=(25, 100))
OPTICAL_RL_GYM_US = 2600.0  # the figure for optical-rl-gym's KSP-FF on this machine


def curve(guard: int, table: Any, fit: str, seeds: int, requests: int, warmup: int) -> list:
    rows = []
    for load in (100, 200, 300, 400):
        results = [
            simulate_lightpaths(
                topology("nsfnet").network(100, 5, table, guard, seed), load, requests + warmup,
                seed=seed, gbit_s=RATES, fit=fit, warmup=warmup,
            )
            for seed in range(seeds)
        ]  # fmt: skip
        sbp, sbp_ci = mean_ci([r.blocking for r in results])
        bbp, bbp_ci = mean_ci([r.bandwidth_blocking for r in results])
        us = sum(r.seconds for r in results) / sum(r.handled for r in results) * 1e6
        rows.append({"load": load, "service_blocking": sbp, "ci95": sbp_ci,
                     "bandwidth_blocking": bbp, "bandwidth_ci95": bbp_ci,
                     "us_per_request": us})  # fmt: skip
    return rows


def numpy_ksp_ff(net: OpticalNetwork, load: float, requests: int, seed: int) -> tuple[float, float]:
    """The same experiment (first fit, guard band, same draws) on numpy boolean rows: blocking
    and microseconds per request. The reference for the speed-up, and a check of the result."""
    rng = np.random.default_rng(seed)
    pairs = list(itertools.permutations(net.sites, 2))
    gaps = rng.exponential(1.0 / load, size=requests)
    holds = rng.exponential(1.0, size=requests)
    which = rng.integers(len(pairs), size=requests)
    rates = RATES.draw(rng, requests)
    busy = np.zeros((len(net.link_ends), net.n_slots), dtype=bool)
    routes = {p: net.routes(*p) for p in pairs}
    heap: list[tuple[float, int, tuple[int, ...], int, int]] = []
    t, blocked, seq = 0.0, 0, 0
    t0 = time.perf_counter()
    for i in range(requests):
        t += float(gaps[i])
        while heap and heap[0][0] <= t:
            _, _, links, start, n = heapq.heappop(heap)
            busy[list(links), start : start + n] = False
        placed = None
        for route in routes[pairs[int(which[i])]]:
            n = route.slots_for(float(rates[i])) + net.guard_band
            free = ~busy[list(route.links)].any(axis=0)
            padded = np.concatenate(([False], free, [False]))
            edges = np.flatnonzero(padded[1:] != padded[:-1])
            for a, b in zip(edges[::2], edges[1::2], strict=True):
                if b - a >= n:
                    placed = (route.links, int(a), n)
                    break
            if placed:
                break
        if placed is None:
            blocked += 1
            continue
        busy[list(placed[0]), placed[1] : placed[1] + placed[2]] = True
        heapq.heappush(heap, (t + float(holds[i]), seq, *placed))
        seq += 1
    return blocked / requests, (time.perf_counter() - t0) / requests * 1e6


def speed(requests: int) -> dict[str, Any]:
    """Per-request time at 200 Erlang, both searches on the same requests, best of 3."""
    ours, ref, same = [], [], True
    for _ in range(3):
        net = topology("nsfnet").network(100, 5, OPTICAL_RL_GYM, 1)
        r = simulate_lightpaths(net, 200, requests, seed=7, gbit_s=RATES, warmup=0)
        ref_blocking, ref_us = numpy_ksp_ff(
            topology("nsfnet").network(100, 5, OPTICAL_RL_GYM, 1), 200, requests, 7
        )
        ours.append(r.us_per_request)
        ref.append(ref_us)
        same = same and abs(r.blocking - ref_blocking) < 1e-12
    return {
        "load": 200,
        "requests": requests,
        "us_per_request": min(ours),
        "numpy_us_per_request": min(ref),
        "speedup_vs_numpy": min(ref) / min(ours),
        "speedup_vs_optical_rl_gym_figure": OPTICAL_RL_GYM_US / min(ours),
        "same_blocking_as_numpy": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--warmup", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    n, w, s = args.requests, args.warmup, args.seeds
    out: dict[str, Any] = {
        "setting": "nsfnet, 100 slots, k=5, uniform 25..100 Gbit/s",
        "reference_first_fit": curve(1, OPTICAL_RL_GYM, "first", s, n, w),
        "reference_best_fit": curve(1, OPTICAL_RL_GYM, "best", s, n, w),
        "no_guard_dmsc_table_first_fit": curve(0, DMSC, "first", s, n, w),
        "speed": speed(n + w),
    }
    single = []
    for load in (5.0, 8.0, 10.0, 12.0):
        net = OpticalNetwork(sites=["a", "b"], link_ends=[("a", "b")], link_km=[100.0],
                             n_slots=10, slot_ghz=12.5, k_paths=1, dc_names=[], dc_sites=[],
                             gpus_total=[])  # fmt: skip
        r = simulate_lightpaths(net, load, n, seed=2, gbit_s=(12.5,), pairs=[("a", "b")])
        single.append({"load": load, "blocking": r.blocking, "erlang_b": erlang_b(load, 10)})
    out["single_link_vs_erlang_b"] = single
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['setting']}; {s} seeds x {n} requests after {w} (95% CI)")
    for name in ("reference_first_fit", "reference_best_fit", "no_guard_dmsc_table_first_fit"):
        print(f"  {name}:")
        for row in out[name]:
            print(
                f"    {row['load']:4d} Erlang: service {row['service_blocking']:.4f} "
                f"± {row['ci95']:.4f}, bandwidth {row['bandwidth_blocking']:.4f} "
                f"± {row['bandwidth_ci95']:.4f}, {row['us_per_request']:.1f} us/request"
            )
    sp = out["speed"]
    print(
        f"speed at 200 Erlang: {sp['us_per_request']:.1f} us/request; numpy rows "
        f"{sp['numpy_us_per_request']:.1f} us ({sp['speedup_vs_numpy']:.1f}x); optical-rl-gym's "
        f"2.6 ms figure / ours: {sp['speedup_vs_optical_rl_gym_figure']:.0f}x; same blocking: "
        f"{sp['same_blocking_as_numpy']}"
    )
    print("One link of 10 slots, one slot per request: simulated vs Erlang B")
    for row in single:
        print(f"  {row['load']:5.1f} Erlang: {row['blocking']:.4f} vs {row['erlang_b']:.4f}")


if __name__ == "__main__":
    main()
