"""How the simulator scales: wall time and events per second from 1,000 to 100,000 job arrivals
on nsfnet-cba (baseline and cba; joint up to 10,000). Prints a table, or with --json one object."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dmsc.sim import OpticalNetwork, build_profiles, load_scenario, run

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--max", type=int, default=100_000)
    args = parser.parse_args()
    scenario, cluster = load_scenario(ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml")
    profiles = build_profiles(cluster, scenario.jobs)
    rows = []
    for name in ("baseline", "cba", "joint"):
        n = 1000
        # joint runs the planner's optimiser per spanning job: 10,000 arrivals at most.
        while n <= (args.max if name != "joint" else min(args.max, 10_000)):
            r = run(
                scenario,
                profiles,
                lambda: OpticalNetwork.for_scenario(scenario, cluster),
                name,
                arrivals=n,
            )
            rows.append(
                {
                    "scheduler": name,
                    "arrivals": n,
                    "events": r.events,
                    "wall_s": r.wall_s,
                    "events_per_s": r.events / r.wall_s,
                }
            )
            n *= 10
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    for row in rows:
        print(
            f"{row['scheduler']:9s} {row['arrivals']:>7d} arrivals: {row['wall_s']:7.2f} s, "
            f"{row['events']:>7d} events, {row['events_per_s']:>9.0f} events/s"
        )


if __name__ == "__main__":
    main()
