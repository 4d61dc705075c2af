"""Data-parallel sync modes in the simulator, on examples/scenarios/nsfnet-cba.yaml: every job of
the mix synchronising every step (as the scenario runs today: pipelines whose stage boundaries
cross datacenters), or as DiLoCo (islands of whole pipelines, one exchange per round crossing),
under every scheduler, over seeds.

Variants: ``every-step``; ``diloco:1`` (islands exchanging every step: the layout alone, the
control); ``diloco:50``; ``diloco:50`` with ``int8``. Per variant and scheduler: blocking
probability (jobs turned away), mean iteration time, bubble ratio (share of running time spent
waiting on the network), spectrum utilisation and lightpath requests, with 95% intervals over
the seeds. The arrival rate is the same in every variant (a DiLoCo job's nominal iteration is
its pipeline's inside one datacenter). ``--arrivals`` and ``--seeds`` shrink the run (the
default, 5 seeds x 2,000 arrivals, takes about two minutes on two cores).

Prints a table, or with --json one object with the same figures; ``--out FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from dmsc.sim import SCHEDULERS, OpticalNetwork, build_profiles, load_scenario, run
from dmsc.sim.metrics import summarize
from dmsc.sim.scenario import with_sync

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml"
VARIANTS: dict[str, dict[str, Any]] = {
    "every-step": {"mode": "every-step"},
    "diloco:1": {"mode": "diloco", "inner_steps": 1},
    "diloco:50": {"mode": "diloco", "inner_steps": 50},
    "diloco:50, int8": {"mode": "diloco", "inner_steps": 50, "compress": "int8"},
}
KEYS = (
    "blocking_probability",
    "mean_iteration_time_s",
    "bubble_ratio",
    "spectrum_utilization",
    "transfer_requests",
    "wall_s",
)


def measure(seeds: int, arrivals: int, schedulers: list[str]) -> dict[str, Any]:
    scenario, cluster = load_scenario(SCENARIO)
    out: dict[str, Any] = {}
    for label, sync in VARIANTS.items():
        variant = scenario.model_copy(update={"jobs": with_sync(scenario.jobs, sync)})
        profiles = build_profiles(cluster, variant.jobs)
        out[label] = {}
        for name in schedulers:
            runs = [
                run(
                    variant,
                    profiles,
                    lambda v=variant: OpticalNetwork.for_scenario(v, cluster),
                    name,
                    seed=scenario.seed + k,
                    arrivals=arrivals,
                )
                for k in range(seeds)
            ]
            s = summarize(runs)
            out[label][name] = {
                **{k: s[k] for k in KEYS},
                "blocking_probability_ci95": s["blocking_probability_ci95"],
                "mean_iteration_time_s_ci95": s["mean_iteration_time_s_ci95"],
                "blocked_gpu": s["blocked_gpu"],
                "blocked_spectrum": s["blocked_spectrum"],
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="One JSON object on stdout.")
    parser.add_argument("--out", help="Also write the JSON object to this file.")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--arrivals", type=int, default=2000, help="Job arrivals per run.")
    parser.add_argument(
        "--schedulers", default=",".join(SCHEDULERS), help="Comma-separated schedulers."
    )
    args = parser.parse_args()
    names = [n for n in args.schedulers.split(",") if n]
    unknown = [n for n in names if n not in SCHEDULERS]
    if unknown or args.seeds <= 0 or args.arrivals <= 0:
        parser.error(f"unknown schedulers {unknown}" if unknown else "seeds, arrivals: > 0")
    t0 = time.perf_counter()
    variants = measure(args.seeds, args.arrivals, names)
    out = {
        "scenario": "nsfnet-cba",
        "seeds": args.seeds,
        "arrivals": args.arrivals,
        "schedulers": names,
        "variants": variants,
        "wall_s": time.perf_counter() - t0,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"nsfnet-cba, {args.seeds} seeds x {args.arrivals} arrivals (95% CI), {out['wall_s']:.0f} s"
    )
    print(
        f"{'sync':16s} {'scheduler':9s} {'blocking':>15s} {'mean iter (s)':>15s} "
        f"{'bubble':>7s} {'spectrum':>9s} {'lightpaths':>10s}"
    )
    for label, per in variants.items():
        for name, s in per.items():
            print(
                f"{label:16s} {name:9s} {s['blocking_probability']:7.3f} "
                f"±{s['blocking_probability_ci95']:.3f} {s['mean_iteration_time_s']:7.2f} "
                f"±{s['mean_iteration_time_s_ci95']:5.2f} {s['bubble_ratio'] * 100:6.1f}% "
                f"{s['spectrum_utilization'] * 100:8.2f}% {s['transfer_requests']:10d}"
            )


if __name__ == "__main__":
    main()
