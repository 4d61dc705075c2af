"""Reproduce the CBA result on examples/scenarios/nsfnet-cba.yaml: baseline, cba and joint over
seeds; the relative change of mean iteration time and blocking probability against baseline.

The paper (004_899cf4a7bfe92fb3.txt) reports -31.25% iteration time and -13.20% blocked requests
for CBA against its baselines. ``--guard-band N`` runs it with N guard-band slots above every
lightpath (the scenario has none, as the paper states none). Prints a table, or with --json one
object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dmsc.sim import load_scenario
from dmsc.sim.sweep import sweep

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--arrivals", type=int, default=2000)
    parser.add_argument("--guard-band", type=int, default=None)
    args = parser.parse_args()
    scenario, cluster = load_scenario(ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml")
    if args.guard_band is not None:
        scenario = scenario.model_copy(update={"guard_band": args.guard_band})
    result = sweep(scenario, cluster, ["baseline", "cba", "joint"], None, args.seeds, args.arrivals)
    summaries = {name: result.summaries[(name, load)] for name, load in result.summaries}
    rel = {n: result.relative(n, result.loads[0]) for n in ("cba", "joint")}
    out = {
        "seeds": args.seeds,
        "arrivals": args.arrivals,
        "guard_band": scenario.guard_band,
        "schedulers": summaries,
        "relative_to_baseline_pct": rel,
        "cba_meets_paper": rel["cba"]["mean_iteration_time_s"] <= -31.25
        and rel["cba"]["blocking_probability"] <= -13.2,
        "joint_beats_cba": summaries["joint"]["mean_iteration_time_s"]
        < summaries["cba"]["mean_iteration_time_s"]
        and summaries["joint"]["blocking_probability"] < summaries["cba"]["blocking_probability"],
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"nsfnet-cba, {args.seeds} seeds x {args.arrivals} arrivals (95% CI), guard band "
        f"{scenario.guard_band}"
    )
    print(
        f"{'scheduler':10s} {'blocking':>16s} {'mean iter (s)':>16s} {'p95 iter':>9s} "
        f"{'bubble':>7s} {'spectrum':>9s} {'GPU':>6s} {'wall':>7s}"
    )
    for name, s in summaries.items():
        print(
            f"{name:10s} {s['blocking_probability']:8.3f} ±{s['blocking_probability_ci95']:.3f}"
            f"   {s['mean_iteration_time_s']:7.2f} ±{s['mean_iteration_time_s_ci95']:.2f}"
            f" {s['p95_iteration_time_s']:9.2f} {s['bubble_ratio'] * 100:6.1f}%"
            f" {s['spectrum_utilization'] * 100:8.1f}% {s['gpu_utilization'] * 100:5.1f}%"
            f" {s['wall_s']:6.1f}s"
        )
    for name, r in rel.items():
        print(
            f"{name} vs baseline: iteration {r['mean_iteration_time_s']:+.1f}%, blocking "
            f"{r['blocking_probability']:+.1f}% (paper, CBA: -31.25% and -13.20%)"
        )
    print(
        f"cba meets the paper: {out['cba_meets_paper']}; joint beats cba: {out['joint_beats_cba']}"
    )


if __name__ == "__main__":
    main()
